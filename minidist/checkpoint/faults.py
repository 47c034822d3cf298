"""Faults: injecting them on purpose, and finding the collective that hangs. Chapter 08
(chapters/08_at_scale.md). Exercised by:

    MINIDIST_FAULT=kill:step:30:1 torchrun --standalone --nproc_per_node=2 --max-restarts=1 \\
        minidist/train_gpt.py --checkpoint-every 20 --resume auto   # rank 1 dies, the job recovers
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --debug-collectives
    pytest tests/test_faults.py

A rank that calls a different collective from its peers hangs the job until the timeout,
and the error names neither the collective nor the rank. Debug mode (trace_collectives)
finds both: before each collective, every rank publishes (sequence number, op, shape,
dtype, calling line) in the rendezvous store and checks every peer's entry under the same
number (CollectiveMismatch). A few store round trips per collective: for debugging only.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from minidist.dist import default_timeout_s


def parse_fault(spec: str | None) -> tuple[str, int, int] | None:
    """MINIDIST_FAULT's (point, step, rank), or None when unset; ValueError, saying the
    expected form, when malformed (train_gpt checks it at start, not when it would fire)."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 4 or parts[0] != "kill" or parts[1] not in ("step", "save") \
            or not all(p.isdigit() for p in parts[2:]):
        raise ValueError(f"MINIDIST_FAULT={spec!r} is not kill:step|save:STEP:RANK "
                         "(e.g. kill:step:30:1); unset it to run without a fault")
    return parts[1], int(parts[2]), int(parts[3])


def check_fault(spec: str | None, world_size: int, steps: int, checkpoint_every: int = 0):
    """parse_fault's answer, or a ValueError naming MINIDIST_FAULT when this run would never
    meet the fault (it would be silently ignored): a rank outside the world, a step outside
    1..steps, a save of a step the run does not save (checkpoints every `checkpoint_every`
    steps, and at the last; 0: none)."""
    fault = parse_fault(spec)
    if fault is None:
        return None
    point, step, rank = fault
    if rank >= world_size:
        problem = f"rank {rank} does not exist in a world of {world_size} (ranks 0 to {world_size - 1})"
    elif not 1 <= step <= steps:
        problem = f"step {step} is not a step of this run (1 to --steps {steps})"
    elif point == "save" and not checkpoint_every:
        problem = "nothing is saved without --checkpoint-every"
    elif point == "save" and step % checkpoint_every and step != steps:
        problem = f"step {step} is not saved (only multiples of --checkpoint-every {checkpoint_every}, and {steps})"
    else:
        return fault
    raise ValueError(f"MINIDIST_FAULT={spec!r}: {problem}, so the fault would never fire: name a rank and "
                     "a step this run has, or unset it")


def inject_fault(point: str, step: int, rank: int) -> None:
    """MINIDIST_FAULT="kill:POINT:STEP:RANK" SIGKILLs rank RANK at POINT ("step": after
    optimizer step STEP; "save": while saving step STEP, after its shard is written and
    before the checkpoint is complete), on a torchrun job's first attempt only."""
    fault = parse_fault(os.environ.get("MINIDIST_FAULT"))
    if not fault or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if fault == (point, step, rank):
        print(f"[minidist] injected fault: SIGKILL rank {rank} at {point} {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class CollectiveMismatch(RuntimeError):
    """Ranks disagree on which collective comes next, or one never came."""


# the collectives minidist and its tests call; point-to-point send/recv are not traced
# (ranks legitimately send different things to different peers)
TRACED = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
          "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "broadcast",
          "reduce", "barrier", "all_gather_object", "broadcast_object_list")

_originals: dict = {}


def _describe(op: str, args, kwargs) -> str:
    first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
    if first is None:
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, list) and a and torch.is_tensor(a[0])]
        first = lists[0][0] if lists else None
    what = "" if first is None else f"{str(first.dtype).replace('torch.', '')}{list(first.shape)}"
    return f"{op}({what})"


def _caller() -> str:
    """The first frame outside torch and this module: the line that asked for it."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "torch" + os.sep not in frame.filename and frame.filename != __file__:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return "?"


class _Tracer:
    def __init__(self, timeout_s: float):
        self.store = dist.distributed_c10d._get_default_store()  # the rendezvous store
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.seq = timedelta(seconds=timeout_s), 0
        self.prefix = "minidist_trace"  # (under torchrun, minidist.dist prefixes each attempt's store)
        self.history: list[str] = []  # this rank's collectives so far (also for debugging)

    def _entry(self, rank: int, seq: int) -> str:
        return self.store.get(f"{self.prefix}/{rank}/{seq}").decode()

    def check(self, op: str, args, kwargs) -> None:
        group = kwargs.get("group")
        if group is not None and group is not dist.group.WORLD:
            return  # subgroups: not traced (their members differ)
        self.seq += 1
        mine = json.dumps([_describe(op, args, kwargs), _caller()])
        self.history.append(mine)
        self.store.set(f"{self.prefix}/{self.rank}/{self.seq}", mine)
        self.store.set(f"{self.prefix}/{self.rank}/last", str(self.seq))
        for peer in range(self.world):
            if peer == self.rank:
                continue
            try:
                self.store.wait([f"{self.prefix}/{peer}/{self.seq}"], self.timeout)
            except Exception:  # the store's timeout: the peer never got here
                last = int(self.store.get(f"{self.prefix}/{peer}/last").decode()) \
                    if self.store.check([f"{self.prefix}/{peer}/last"]) else 0
                theirs = f"#{last}: {self._show(self._entry(peer, last))}" if last else "none"
                raise CollectiveMismatch(
                    f"rank {peer} did not reach collective #{self.seq} within "
                    f"{self.timeout.total_seconds():g} s; rank {self.rank} is waiting in "
                    f"{self._show(mine)}. Rank {peer}'s last collective was {theirs}") from None
            theirs = self._entry(peer, self.seq)
            if json.loads(theirs)[0] != json.loads(mine)[0]:
                raise CollectiveMismatch(
                    f"ranks diverge at collective #{self.seq}: rank {self.rank} calls "
                    f"{self._show(mine)}, rank {peer} calls {self._show(theirs)}. Every rank "
                    f"must run the same collectives in the same order (collectives #1-"
                    f"#{self.seq - 1} agreed)")

    @staticmethod
    def _show(entry: str) -> str:
        what, where = json.loads(entry)
        return f"{what} at {where}"


def trace_collectives(timeout_s: float | None = None) -> None:
    """Debug mode: check every collective on the default group against every peer's
    (call after the process group exists, on every rank). A peer is waited for timeout_s,
    by default MINIDIST_TIMEOUT (as the process group's collectives are) or 60 s.
    stop_tracing() undoes it."""
    if _originals:
        return
    tracer = _Tracer(timeout_s or default_timeout_s(60.0))  # (checked: 1e300 would overflow timedelta)
    for name in TRACED:
        fn = getattr(dist, name)
        _originals[name] = fn

        @functools.wraps(fn)
        def traced(*args, _fn=fn, _name=name, **kwargs):
            tracer.check(_name, args, kwargs)
            return _fn(*args, **kwargs)
        setattr(dist, name, traced)


def stop_tracing() -> None:
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()


# ---------------------------------------------------------------- endings: signals, lost peers

class StopOnSignal:
    """SIGTERM and SIGINT become a clean stop at the end of the current step (a checkpoint
    saved with --checkpoint-every, the command to resume named). A second signal some
    seconds later acts at once. Installed only in the main thread; undone on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, patience_s: float = 3.0):
        self.signum, self.first_at, self.patience_s, self.previous = None, 0.0, patience_s, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum, self.first_at = signum, time.monotonic()
        elif time.monotonic() - self.first_at > self.patience_s:  # (not torchrun forwarding
            self.__exit__()                                        # a Ctrl-C the ranks also got)
            signal.raise_signal(signum)


def any_signal(signum) -> int:
    """The signal any rank was sent (0: none), agreed by all (a tiny all-reduce): the ranks
    get it at different moments, and must stop after the same step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return signum or 0
    flag = torch.tensor([signum or 0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def is_collective_failure(e: BaseException) -> bool:
    """An error a collective raised because a peer is gone or late: the consequence of
    another rank's failure, which that rank reports itself."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(
        w in text for w in ("gloo", "nccl", "connection closed", "connection reset", "timed out"))
