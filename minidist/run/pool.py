"""Pool(world_size): launch's processes kept alive across many calls, for many short
multi-process runs in a row (the test suite, the exercise grader).

Chapter 02 (chapters/02_collectives.md) introduces launch, which this builds on.
Exercised by `pytest tests/test_dist.py` and by every test that takes the `pool` fixture
(tests/conftest.py).
"""

from __future__ import annotations

import atexit

from minidist.dist import default_timeout_s
from minidist.run.launch import (check_times, choose_backend, collect_results, dumps, raise_failure, start_ranks,
                                 stop_ranks)


class Pool:
    """`world_size` processes kept alive across calls: `run(fn, *args)` is launch without
    the process start. A context manager, or call close(). Each call gets a new process
    group and a fresh process's RNG state, environment, thread count and default dtype;
    other global state it changes (a patched module) stays. A failed call is re-raised as
    launch would, and stops every process: the next call starts fresh ones.
    """

    def __init__(self, world_size: int, backend: str | None = None, device: str | None = None,
                 timeout_s: float = 120.0, grace_s: float = 1.0):
        self.world_size = world_size
        self.backend, self.device_type = choose_backend(world_size, backend, device)
        check_times(timeout_s, grace_s, None)
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self._group = None  # (store, processes, results, task queues), started on first use
        self.starts = 0     # how many groups it has started: 1 unless calls failed

    def run(self, fn, *args, timeout_s: float | None = None, deadline_s: float | None = None) -> list:
        """fn(*args) on every rank of the pool; the list of return values, by rank.
        `timeout_s` (the pool's by default) and `deadline_s` are launch's."""
        check_times(self.timeout_s if timeout_s is None else timeout_s, self.grace_s, deadline_s)
        if self._group is None:
            self._group = start_ranks(self.world_size, self.backend, self.device_type,
                                      self.timeout_s, None, pooled=True)
            self.starts += 1
        _, procs, results, tasks = self._group
        task = (dumps((fn, args)), self.timeout_s if timeout_s is None else timeout_s)
        for q in tasks:
            q.put(task)
        failure = "interrupted"  # (Ctrl-C) until collect_results returns: the ranks' state is unknown
        try:
            outputs, failure = collect_results(procs, results, self.grace_s, deadline_s)
        finally:
            if failure is not None:
                self.close(wait_s=0)
        if failure is not None:
            raise_failure(failure, self.world_size)
        return [outputs[r] for r in range(self.world_size)]

    def close(self, wait_s: float = 10.0) -> None:
        """Stop the processes (a later run starts new ones)."""
        if self._group is not None:
            _, procs, results, tasks = self._group
            self._group = None
            for p, q in zip(procs, tasks):
                if wait_s and p.is_alive():
                    q.put(None)  # finish: leave the group and exit
            stop_ranks(procs, results, wait_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_SHARED: dict = {}  # world size -> Pool
atexit.register(lambda: [p.close() for p in _SHARED.values()])


def shared_pool(world_size: int) -> Pool:
    """The Pool of `world_size` ranks that this Python process shares (started on first
    use, stopped at exit): one process start per world size, not one per test."""
    if world_size not in _SHARED:
        _SHARED[world_size] = Pool(world_size, timeout_s=default_timeout_s(120.0))
    return _SHARED[world_size]
