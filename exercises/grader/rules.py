"""What an exercise forbids, and what the collectives of the code under test carried.

Inside `watch(rules)` (around each graded part and check), in this process: every call of
a ProcessGroup method (what dist.all_reduce, dist.send, ... end in, under whatever name
they were imported) is recorded as an `Event` (`events()` reads them); a collective
outside `rules.collectives`, or a call of a class or function in `rules.forbidden`, is
noted as broken: the part or check scores 0, and the message names the call, the line of
the code that made it, and what to use instead. A collective goes on, so that no other
rank is left waiting; a forbidden class or function raises RuleBroken (what it would
build is the answer).

Whose call it is: the first frame on the stack outside torch and the standard library. A
call the grader's own files make (their oracle) is neither recorded nor judged; one from
the learner's file, or from minidist's code it calls, is both (feedback, not a sandbox).
"""

import functools
import os
import sys
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from exercises.grader import forbid
from exercises.grader.memory import tensors_in
RuleBroken = forbid.RuleBroken  # where tests and checks find it

# ProcessGroup methods and the torch.distributed call each stands for (for messages).
METHODS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
           "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
           "allgather_coalesced": "all_gather_coalesced",
           "allgather_into_tensor_coalesced": "all_gather_into_tensor",
           "all_gather_single": "all_gather_into_tensor",
           "all_gather_single_coalesced": "all_gather_into_tensor",
           "reduce_scatter_single": "reduce_scatter_tensor",
           "reduce_scatter_single_coalesced": "reduce_scatter_tensor",
           "all_to_all_single": "all_to_all_single",
           "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter_tensor",
           "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
           "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
           "broadcast": "broadcast", "reduce": "reduce", "gather": "gather",
           "scatter": "scatter", "barrier": "barrier", "monitored_barrier": "monitored_barrier",
           "send": "send", "recv": "recv", "recv_anysource": "recv"}


@dataclass(frozen=True)
class Rules:
    """`collectives`: the torch.distributed calls allowed (METHODS' values; "send"/"recv" cover
    isend/irecv), or None for any. `forbidden`: {"module:name" or "module:Class.method":
    what to use instead}."""
    collectives: frozenset | None = None
    collective_rule: str = ""
    forbidden: dict = field(default_factory=dict)


@dataclass
class Event:
    kind: str            # the torch.distributed call: "all_reduce", "send", ...
    group: tuple         # the global ranks of the group
    peer: int | None     # a message's other end (a global rank)
    sent: int            # bytes this rank contributes
    received: int        # bytes this rank receives
    shapes: tuple        # the shapes of the tensors it sends
    where: str           # file:line of the call


class Watch:
    def __init__(self, rules: Rules | None):
        self.rules, self.broken, self.events = rules, [], []

    def note(self, what: str, where: str, instead: str) -> None:
        msg = f"{what} at {where}, which this exercise forbids: {instead}"
        if msg not in self.broken:
            self.broken.append(msg)


_CURRENT: list = []  # the watches in force, innermost last
_ORACLE = [0]        # > 0: the grader's own code runs (oracle())
_SKIP = tuple(os.path.realpath(p) + os.sep for p in
              {os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]})
_GRADER = os.path.dirname(os.path.realpath(__file__)) + os.sep
_WRAPPERS = {os.path.realpath(__file__), os.path.realpath(forbid.__file__)}


def _caller() -> tuple[str, bool]:
    """(file:line of the first frame outside torch, the standard library and the watch's
    own wrappers; whether that frame is the grader's own)."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.realpath(f.f_code.co_filename)
        if not path.startswith(_SKIP) and path not in _WRAPPERS:
            short = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
            return f"{short}:{f.f_lineno}", path.startswith(_GRADER)
        f = f.f_back
    return "?", False


def current() -> Watch | None:
    return _CURRENT[-1] if _CURRENT else None


def events() -> list[Event]:
    """What the code under test sent and received so far in this part, on this rank."""
    w = current()
    if w is None:
        raise RuntimeError("no part is being watched on this process")
    return w.events


def ring_direction(what: str, start: int, r: int, n: int) -> str | None:
    """None when every message of the code under test since events()[start] went to the
    right neighbour or came from the left one, else the first that did not."""
    right, left = (r + 1) % n, (r - 1) % n
    for e in events()[start:]:
        if e.kind == "send" and e.peer != right:
            return (f"{what} on {n} ranks: rank {r} sent {e.sent} bytes to rank {e.peer} at "
                    f"{e.where}; in the ring it sends only to rank {right}, (r+1) % N")
        if e.kind == "recv" and e.peer != left:
            src = "any source" if e.peer is None else f"rank {e.peer}"
            return (f"{what} on {n} ranks: rank {r} received from {src} at {e.where}; in "
                    f"the ring it receives only from rank {left}, (r-1) % N")
    return None


def randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@contextmanager
def watch(rules: Rules | None):
    """Record and judge the code under test for the length of the block (see above)."""
    _install_methods()
    forbid.install(rules.forbidden if rules else {})
    w = Watch(rules)
    _CURRENT.append(w)
    try:
        yield w
    finally:
        _CURRENT.remove(w)


@contextmanager
def oracle():
    """The grader's own calls from code outside its files (minidist's, as an oracle)."""
    _ORACLE[0] += 1
    try:
        yield
    finally:
        _ORACLE[0] -= 1


def _judged() -> tuple[Watch | None, str]:
    w = current()
    if w is None or _ORACLE[0]:
        return None, ""
    where, grader = _caller()
    return (None, "") if grader else (w, where)


# --------------------------------------------------------------------- the collectives

def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(x))


def _layout(method: str, a: tuple) -> tuple[object, object, int | None]:
    """(what it sends, what it receives into, the group rank of a message's peer)."""
    if method == "send":
        return a[0], None, a[1]
    if method in ("recv", "recv_anysource"):  # from any source: no peer
        return None, a[0], a[1] if method == "recv" else None
    if method in ("allreduce", "allreduce_coalesced", "broadcast", "reduce"):
        return a[0], a[0], None
    if method in ("barrier", "monitored_barrier"):
        return None, None, None
    # (outputs, inputs, ...): all_gather, reduce_scatter, all_to_all, gather, scatter
    return (a[1] if len(a) > 1 else None), (a[0] if a else None), None


def _record(pg, method: str, a: tuple) -> None:
    w, where = _judged()
    if w is None:
        return
    import torch.distributed as dist
    kind = METHODS[method]
    sends, into, peer = _layout(method, a)
    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except Exception:  # a group torch does not know: still recorded
        ranks = ()
    if peer is not None and ranks:
        peer = ranks[peer]
    w.events.append(Event(kind, ranks, peer, _nbytes(sends), _nbytes(into),
                           tuple(tuple(t.shape) for t in tensors_in(sends)), where))
    allowed = w.rules.collectives if w.rules else None
    if allowed is not None and kind not in allowed:
        rule = w.rules.collective_rule or (
            "use only dist." + ", dist.".join(sorted(allowed)) if allowed else "no collectives here")
        w.note(f"dist.{kind} was called", where, rule)


_INSTALLED: set = set()


def _install_methods() -> None:
    """Record every ProcessGroup method call (once per process, for good: outside a
    watch the wrapper only passes the call on)."""
    if "methods" in _INSTALLED:
        return
    PG = torch._C._distributed_c10d.ProcessGroup
    for method in METHODS:
        orig = getattr(PG, method, None)
        if orig is None:
            continue

        def wrapper(self, *a, __orig=orig, __m=method, **k):
            if _CURRENT:
                _record(self, __m, a)
            return __orig(self, *a, **k)
        setattr(PG, method, functools.wraps(orig)(wrapper))
    _INSTALLED.add("methods")
