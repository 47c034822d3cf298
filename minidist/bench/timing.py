"""The benchmarks' one way of timing: torch.utils.benchmark.Timer. Chapter 08
(chapters/08_at_scale.md) gathers the benchmarks; every timed loop of minidist/bench/
goes through this module. Exercised by tests/test_bench.py.

Timer synchronises the accelerator when it reads the clock, turns the garbage collector off
and runs warm-up calls before each block. Chosen here once: the process's own thread count
(Timer's default is one); a fixed count of calls per block, never blocked_autorange, because
every rank must make the same collective calls or they deadlock; and `before`, run untimed
ahead of each block (a barrier there starts every rank's block together).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.benchmark import Measurement, Timer
from torch.utils.benchmark import timer as clock  # Timer's own clock: synchronised, for parts of a call

__all__ = ["clock", "timer", "measure", "interleaved"]


def timer(fn: Callable[[], object], before: Callable[[], object] | None = None,
          clock_fn: Callable[[], float] | None = None) -> Timer:
    """A Timer of fn(); before() runs ahead of each timed block, untimed; clock_fn replaces
    the wall clock (time.process_time: CPU seconds of this process)."""
    kw = {} if clock_fn is None else {"timer": clock_fn}
    return Timer("fn()", setup="before()", globals={"fn": fn, "before": before or (lambda: None)},
                 num_threads=torch.get_num_threads(), **kw)


def measure(fn: Callable[[], object], repeat: int, number: int = 1, before=None, clock_fn=None) -> Measurement:
    """`repeat` blocks of `number` calls of fn; the Measurement's times are per call, one
    per block (its .median is the median block, min(.times) the best of them)."""
    t = timer(fn, before, clock_fn)
    return Measurement.merge([t.timeit(number) for _ in range(repeat)])[0]


def interleaved(fns: dict, rounds: int, number: int = 1, before=None, after=None) -> dict[str, Measurement]:
    """Per name, `rounds` blocks of `number` calls of fns[name], the names taking turns in
    every round so that drift in a shared machine's load hits them all alike.
    before(name) runs ahead of each block, untimed; after(name, block) sees each block's
    Measurement as soon as it is taken."""
    timers = {k: timer(fn, (lambda k=k: before(k)) if before else None) for k, fn in fns.items()}
    blocks = {k: [] for k in fns}
    for _ in range(rounds):
        for k, t in timers.items():
            blocks[k].append(t.timeit(number))
            if after:
                after(k, blocks[k][-1])
    return {k: Measurement.merge(b)[0] for k, b in blocks.items()}
