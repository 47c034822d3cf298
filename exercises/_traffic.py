"""Every byte a rank moves, seen below torch.distributed's Python: the grader's recorder.

A graded multi-process part runs inside `recording(...)` (exercises/_harness.py does it for
every part). For as long as it runs, on this rank:

- every collective and point-to-point call is recorded where every road to gloo meets:
  the c10d operators of torch's dispatcher (c10d::allreduce_, c10d::send, ...), through a
  kernel registered in front of the backend's (at the BackendSelect key, which every call
  of an operator passes). dist.all_reduce, a ProcessGroup's own methods, torch.ops.c10d,
  the functional collectives (whose C++ calls the group's methods) and batch_isend_irecv
  all end there, whatever name the learner's code reached them by and whenever it
  captured it. Each call is an `Event`: its kind, the ProcessGroup method it stands for,
  the group, the peer (a global rank) of a message, the bytes it sends and receives, a
  copy of what it sends, and the tensors it receives into;
- whatever moves data outside those calls breaks a rule, naming what it saw: a
  call on a process group the grader did not hand out (one the learner's code made, or
  any other); a method of a group's backend object called directly (below the
  dispatcher); the rendezvous store (its methods, or a new store), and making a process
  group at all. The grader's own calls run in exercises._rules.exempt() and are neither
  recorded nor refused; torch's own Python, calling the store or a backend on behalf of a
  call the learner made, is not refused here (the call itself is what is judged);
- the exercise's rules on collectives (Rules.allowed) are enforced at the same place, and
  Rules.on_traffic, a function of (event, rank, world size) -> what is wrong or None,
  judges every event when it happens (exercise 02's right-neighbour rule).

A broken rule is noted on the part's watch (the part scores 0, with the message) and the
call goes on: raising on one rank could leave the others waiting for it.

What the learner's code might still do that no hook sees (a handle to a backend method
taken before the part began, a socket) is for the checks to catch: they check that the
recorded traffic carries the data the results need (a ring's sums arrive in its
messages, a bucket's all-reduce carries the gradients), in the same run that counts.

`counting_matmuls()` is the same idea for work: every matrix product of any thread, with
its shapes, seen at the dispatcher.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from exercises import _rules

_BS = torch._C.DispatchKey.BackendSelect

# c10d operator -> (the ProcessGroup method it stands for, kind)
OPS = {
    "allreduce_": ("allreduce", "all_reduce"),
    "allreduce_coalesced_": ("allreduce_coalesced", "all_reduce"),
    "allgather_": ("allgather", "all_gather"),
    "_allgather_base_": ("_allgather_base", "all_gather"),
    "allgather_coalesced_": ("allgather_coalesced", "all_gather"),
    "allgather_into_tensor_coalesced_": ("allgather_into_tensor_coalesced", "all_gather"),
    "reduce_scatter_": ("reduce_scatter", "reduce_scatter"),
    "_reduce_scatter_base_": ("_reduce_scatter_base", "reduce_scatter"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
    "broadcast_": ("broadcast", "broadcast"),
    "reduce_": ("reduce", "reduce"),
    "gather_": ("gather", "gather"),
    "scatter_": ("scatter", "scatter"),
    "alltoall_": ("alltoall", "all_to_all"),
    "alltoall_base_": ("alltoall_base", "all_to_all"),
    "send": ("send", "send"),
    "recv_": ("recv", "recv"),
    "recv_any_source_": ("recv_anysource", "recv"),
    "barrier": ("barrier", "barrier"),
    "monitored_barrier_": ("monitored_barrier", "barrier"),
}
# what torch.distributed calls them, for messages
DIST_NAME = {"allreduce": "dist.all_reduce", "allreduce_coalesced": "dist.all_reduce_coalesced",
             "allgather": "dist.all_gather", "_allgather_base": "dist.all_gather_into_tensor",
             "allgather_coalesced": "dist.all_gather_coalesced",
             "allgather_into_tensor_coalesced": "a coalesced all_gather_into_tensor",
             "reduce_scatter": "dist.reduce_scatter", "_reduce_scatter_base": "dist.reduce_scatter_tensor",
             "reduce_scatter_tensor_coalesced": "a coalesced reduce_scatter_tensor",
             "broadcast": "dist.broadcast", "reduce": "dist.reduce", "gather": "dist.gather",
             "scatter": "dist.scatter", "alltoall": "dist.all_to_all",
             "alltoall_base": "dist.all_to_all_single", "send": "dist.send/isend",
             "recv": "dist.recv/irecv", "recv_anysource": "dist.recv without a source",
             "barrier": "dist.barrier", "monitored_barrier": "dist.monitored_barrier"}
# the methods of a group's backend object that move data (or synchronise)
_BACKEND_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base",
                    "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
                    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "broadcast",
                    "reduce", "gather", "scatter", "alltoall", "alltoall_base", "send", "recv",
                    "recv_anysource", "barrier", "monitored_barrier")
_STORE_METHODS = ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys",
                  "multi_get", "multi_set", "append", "queue_push", "queue_pop", "queue_len",
                  "list_keys", "barrier")
_STORE_CLASSES = ("Store", "TCPStore", "FileStore", "HashStore", "PrefixStore")

OTHER_WAYS = ("data moves between ranks only through the collectives and messages of the "
              "process groups the grader hands out, where it records them: no process group of "
              "your own, no backend object called directly, no rendezvous store")

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep


class Event:
    """One call: kind ("all_reduce", "send", ...), op (the ProcessGroup method), group
    (its name), handed (a group the grader handed out), peer (a message's other rank,
    global; the root of a rooted collective), sent / received (bytes this rank puts in /
    gets out, as the call's buffers say), data (copies of what it sends, taken at the
    call), outputs (the tensors it receives into, read after they complete), async_,
    phase (the grader's label of when it happened), args (the call's arguments less the
    group)."""

    __slots__ = ("kind", "op", "group", "handed", "peer", "sent", "received", "data", "outputs",
                 "async_", "phase", "args", "pg")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def __repr__(self):
        return f"Event{(self.kind, self.op, self.peer, self.sent, self.received, self.phase)}"


def tensors_in(x) -> list:
    """The tensors in x: a tensor, or lists and tuples of them (nested)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors_in(y)]
    return []


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(x))


def _layout(op: str, a: tuple) -> tuple[list, list, int | None]:
    """(what this rank sends, what it receives into, the root or peer (a group rank)) of
    operator `op` called with arguments `a` (the group left out)."""
    if op in ("allreduce_", "allreduce_coalesced_"):
        return tensors_in(a[0]), tensors_in(a[0]), None
    if op in ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
              "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
              "alltoall_", "alltoall_base_"):
        return tensors_in(a[1]), tensors_in(a[0]), None
    if op == "broadcast_":
        return tensors_in(a[0]), tensors_in(a[0]), a[1]
    if op == "reduce_":
        return tensors_in(a[0]), tensors_in(a[0]), a[2]
    if op == "gather_":
        return tensors_in(a[1]), tensors_in(a[0]), a[2]
    if op == "scatter_":
        return tensors_in(a[1]), tensors_in(a[0]), a[2]
    if op == "send":
        return tensors_in(a[0]), [], a[1]
    if op == "recv_":
        return [], tensors_in(a[0]), a[1]
    if op == "recv_any_source_":
        return [], tensors_in(a[0]), None
    return [], [], None  # the barriers


def _async(op: str, a: tuple) -> bool:
    if op in ("send", "recv_", "recv_any_source_"):
        return True  # the caller decides by waiting (isend) or not (send)
    flags = [x for x in a if isinstance(x, bool)]
    return flags[0] if flags else True


def _global(pg, r):
    if r is None or pg is None:
        return r
    try:
        return dist.get_global_rank(pg, r)
    except Exception:  # a group torch does not know (made by hand): its own numbering
        return r


# --------------------------------------------------------------------- the recordings in force

_ACTIVE: list = []       # the Traffic objects recording on this rank (innermost last)
_INSTALLED: list = []    # what recording installed: (undo functions), while _ACTIVE is not empty
_LOCK = threading.RLock()
KEEP_LIMIT = 256 << 20   # bytes of copies one recording keeps; beyond, only sizes


def _from_torch(depth: int = 2) -> bool:
    """Was the function `depth` frames up called by torch's own Python (the internals of
    a call whose own recording judges it)?"""
    f = sys._getframe(depth)
    return f is not None and os.path.realpath(f.f_code.co_filename).startswith(_TORCH_DIR)


class Traffic:
    """What one part moved on this rank (see the module docstring)."""

    def __init__(self, watch=None, rules=None, keep: bool = True):
        self.watch, self.rules, self.keep = watch, rules, keep
        self.events: list[Event] = []
        self.listeners: list = []   # on_call(event) of the grader's own recorders
        self.kept = 0
        self.phase = None
        self.broken: list[str] = []  # what tripped (also on the watch, when there is one)
        self.handed: set = set()
        if dist.is_available() and dist.is_initialized():
            self.hand_out(dist.group.WORLD)

    def hand_out(self, group) -> None:
        """`group` is the learner's to use in this part (the default group always is)."""
        if group is not None:
            self.handed.add(group.group_name)

    @contextmanager
    def phase_of(self, label):
        """Events inside are labelled `label` (when they happened: a step, a backward)."""
        before, self.phase = self.phase, label
        try:
            yield
        finally:
            self.phase = before

    def trip(self, api: str, rule: str) -> None:
        """Record a broken rule: the part scores 0. The call goes on (see _rules.Watch.note)."""
        msg = f"{api} was called, which this exercise forbids: {rule}"
        if msg not in self.broken:
            self.broken.append(msg)
        if self.watch is not None:
            self.watch.note(api, rule)

    # ---- one call of a c10d operator
    def seen(self, op: str, pg, a: tuple) -> None:
        method, kind = OPS[op]
        sends, recvs, peer = _layout(op, a)
        e = Event(kind=kind, op=method, group=getattr(pg, "group_name", "?"),
                  handed=pg is not None and getattr(pg, "group_name", None) in self.handed,
                  peer=_global(pg, peer), sent=_nbytes(sends), received=_nbytes(recvs),
                  async_=_async(op, a), phase=self.phase, args=a, pg=pg, outputs=recvs)
        if self.keep and self.kept + e.sent <= KEEP_LIMIT:
            e.data = [t.detach().clone() for t in sends]
            self.kept += e.sent
        self.events.append(e)
        for listen in list(self.listeners):
            listen(e)
        if not e.handed:
            self.trip(f"{DIST_NAME.get(method, method)} on a process group the grader did not hand "
                      f"out (group '{e.group}')", OTHER_WAYS)
        rules = self.rules
        if (rules is not None and rules.allowed is not None and method in _rules.COLLECTIVES
                and method not in rules.allowed):  # (Rules.allowed restricts collectives, not messages)
            self.trip(f"{DIST_NAME.get(method, method)} (c10d {op})", rules.collective_rule)
        judge = getattr(rules, "on_traffic", None)
        if judge is not None and dist.is_initialized():
            why = judge(e, dist.get_rank(), dist.get_world_size())
            if why:
                api, rule = why if isinstance(why, tuple) else (why, rules.collective_rule)
                self.trip(api, rule)


def _kernel(op: str):
    overload = getattr(torch.ops.c10d, op).default

    def kernel(keyset, *args, **kwargs):
        if _ACTIVE and not _rules._exempt():
            at = next((i for i, x in enumerate(args) if isinstance(x, torch.ScriptObject)), None)
            pg = None
            if at is not None:
                try:
                    pg = dist.ProcessGroup.unbox(args[at])
                except Exception:
                    pg = None
            rest = args[:at] + args[at + 1:] if at is not None else args
            for t in list(_ACTIVE):
                t.seen(op, pg, rest)
        return overload.redispatch(keyset.remove(_BS), *args, **kwargs)
    return kernel


def _refuse_below(name: str, orig):
    """A backend's method, called directly: below the dispatcher, so refused."""
    def wrapper(self, *args, **kwargs):
        if _ACTIVE and not _rules._exempt() and not _from_torch():
            _ACTIVE[-1].trip(f"{type(self).__name__}.{name}, on a process group's backend object "
                             "(below torch.distributed, where nothing is recorded)", OTHER_WAYS)
        return orig(self, *args, **kwargs)
    return wrapper


def _refuse_store(owner: str, name: str, orig):
    def wrapper(*args, **kwargs):
        if _ACTIVE and not _rules._exempt() and not _from_torch():
            what = f"{owner}(...), a new store" if name == "__init__" else f"{owner}.{name}"
            _ACTIVE[-1].trip(f"{what}: the rendezvous store (or one of your own) moves data "
                             "around the recorded collectives", OTHER_WAYS)
        return orig(*args, **kwargs)
    return wrapper


def _refuse_group(what: str, orig, hand_out_result: bool):
    def wrapper(*args, **kwargs):
        if _ACTIVE and not _rules._exempt():
            _ACTIVE[-1].trip(f"{what}: a process group of your own", OTHER_WAYS)
        out = orig(*args, **kwargs)
        if hand_out_result and _ACTIVE:  # the grader's own group, made in exempt(): the learner's to use
            pg = out[0] if isinstance(out, tuple) else out
            if isinstance(pg, dist.ProcessGroup):
                for t in _ACTIVE:
                    t.hand_out(pg)
        return out
    return wrapper


def _install() -> list:
    """Put the recorder in place; the functions that take it away again."""
    undo = []
    lib = torch.library.Library("c10d", "IMPL")
    for op in OPS:
        if hasattr(torch.ops.c10d, op):
            lib.impl(op, _kernel(op), "BackendSelect", with_keyset=True)
    undo.append(lib._destroy)

    def patch(owner, name, value):
        missing = object()
        old = owner.__dict__.get(name, missing)
        setattr(owner, name, value)
        undo.append(lambda: delattr(owner, name) if old is missing else setattr(owner, name, old))

    # the C++ Backend class that every backend object (ProcessGroupGloo, ...) is made of
    # (dist.Backend is another thing: the names of the backends)
    backends = [c for c in (getattr(torch._C._distributed_c10d, "Backend", None),
                            getattr(dist, "ProcessGroupGloo", None)) if c]
    for cls in backends:
        for name in _BACKEND_METHODS:
            if name in cls.__dict__:
                patch(cls, name, _refuse_below(name, getattr(cls, name)))
    for cname in _STORE_CLASSES:
        cls = getattr(dist, cname, None)
        if cls is None:
            continue
        for name in (*_STORE_METHODS, "__init__"):
            if name in cls.__dict__:
                patch(cls, name, _refuse_store(cname, name, getattr(cls, name)))
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    patch_mod = lambda mod, name, value: _patch_module(undo, mod, name, value)  # noqa: E731
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is not None:
        patch_mod(c10d, "_new_process_group_helper",
                  _refuse_group("dist.new_group (or another way of making a process group)", helper, True))
    for cls in [dist.ProcessGroup] + backends[1:]:
        patch(cls, "__init__", _refuse_group(f"{cls.__name__}(...)", cls.__init__, False))
    return undo


def _patch_module(undo: list, mod, name: str, value) -> None:
    old = getattr(mod, name)
    setattr(mod, name, value)
    undo.append(lambda: setattr(mod, name, old))


@contextmanager
def recording(watch=None, rules=None, keep: bool = True):
    """Record (and police) this rank's traffic while the block runs: yields a Traffic."""
    t = Traffic(watch, rules, keep)
    with _LOCK:
        if not _ACTIVE:
            _INSTALLED[:] = _install()
        _ACTIVE.append(t)
    try:
        yield t
    finally:
        with _LOCK:
            _ACTIVE.remove(t)
            if not _ACTIVE:
                for f in reversed(_INSTALLED):
                    f()
                _INSTALLED.clear()


def current() -> Traffic | None:
    """The innermost recording on this rank (the part's), or None."""
    return _ACTIVE[-1] if _ACTIVE else None


# --------------------------------------------------------------------- work: matrix products

_MATMULS = ("mm", "bmm", "baddbmm", "addmm", "addbmm", "mv", "addmv", "dot", "vdot")
# products written as convolutions (a linear layer is a 1x1 convolution): counted too, from
# the output's size (forward) or the gradients' (backward)
_CONVS = ("convolution", "convolution_backward")


def _flops(op: str, shapes: list) -> int:
    """2 x multiply-adds of one matrix product, from its operands' shapes."""
    def prod(s):
        out = 1
        for x in s:
            out *= x
        return out
    if op in ("mm", "addmm"):
        a, b = shapes[-2], shapes[-1]
        return 2 * a[0] * a[1] * b[1]
    if op in ("bmm", "baddbmm", "addbmm"):
        a, b = shapes[-2], shapes[-1]
        return 2 * a[0] * a[1] * a[2] * b[2]
    if op in ("mv", "addmv"):
        return 2 * prod(shapes[-2])
    return 2 * prod(shapes[-1])  # dot, vdot


@contextmanager
def counting_matmuls():
    """Yields a list that receives (op, operand shapes, FLOPs) for every matrix product
    computed while the block runs, on any thread (seen at the dispatcher)."""
    seen: list = []
    lib = torch.library.Library("aten", "IMPL")

    def kernel_of(op):
        overload = getattr(torch.ops.aten, op).default

        def kernel(keyset, *args, **kwargs):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            seen.append((op, shapes, _flops(op, shapes)))
            return overload.redispatch(keyset.remove(_BS), *args, **kwargs)
        return kernel
    def conv_kernel_of(op):
        overload = getattr(torch.ops.aten, op).default

        def kernel(keyset, *args, **kwargs):
            out = overload.redispatch(keyset.remove(_BS), *args, **kwargs)
            weight = args[2] if op == "convolution_backward" else args[1]
            per_output = 2 * weight[0].numel()  # multiply-adds of one output element
            if op == "convolution":
                flops = per_output * out.numel()
            else:  # grad_input and grad_weight: each as many as the forward
                flops = 2 * per_output * args[0].numel()
            seen.append((op, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)], flops))
            return out
        return kernel
    for op in _MATMULS:
        lib.impl(op, kernel_of(op), "BackendSelect", with_keyset=True)
    for op in _CONVS:
        lib.impl(op, conv_kernel_of(op), "BackendSelect", with_keyset=True)
    try:
        yield seen
    finally:
        lib._destroy()
