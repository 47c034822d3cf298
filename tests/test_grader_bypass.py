"""Solutions that go around what an exercise teaches score 0 on the parts they break.

Issue 26, items 1, 3 and 4, proven with rule-breaking solutions, at least two per kind
and exercise (the other kinds, and the mistakes of a learner, are in test_grader_safety.py
and test_exercise_NN.py):

- below Python (exercises/_traffic.py): data moved on a process group of the learner's
  own, through a group's backend object, the store, or torch's registered operators scores
  0 naming what was seen; and data moved where no hook can see it (a backend method or a
  store method captured before grading) fails because the recorded traffic does not carry
  the results (a ring's chunks, a bucket's gradients, a reduce-scatter's gradients, an
  all-gather's updates, a verdict's flag, a token count);
- where work and memory really are (exercises/_measure.py, _traffic.counting_matmuls):
  optimizer state or full gradients kept out of sight of self.state, every rank doing
  every matrix's Newton-Schulz while the state looks sharded, activations kept on a
  Function's context, in a global, or behind saved-tensor hooks of the learner's own;
- docstrings enforced: ZeRO's units reduced in index order; part (a) of exercise 07
  without minidist's Newton-Schulz (07(a)); (02's right neighbour in every part and 05's
  refused misuses are in test_exercise_02.py and test_exercise_05.py).

Processes are shared: each exercise's rule-breaking solutions run in one launch on 2
ranks (the shared pool), only the parts they need, and each is then graded from its
share of the results, as the grader would grade it. The solutions live at module level:
cloudpickle ships them to the ranks by name, and what they capture "before grading" they
capture when the ranks import this module, before any part runs.
"""

import functools
import io
import itertools
import os

import pytest
import torch
import torch.distributed as dist

from exercises import _harness as H
from exercises import checks_02 as C2
from exercises import checks_03 as C3
from exercises import checks_04 as C4
from exercises import checks_05 as C5
from exercises import checks_06 as C6
from exercises import checks_07 as C7
from exercises import checks_08 as C8
from exercises import grade as G
from minidist.ddp import DDP
from test_exercise_05 import Plain as PlainScaler
from test_exercise_06 import Plain as PlainZero
from test_exercise_07 import PlainMuon, plain_ns

# ---------------------------------------------------------------- hidden channels
# Taken when this module is imported (on a rank: when the first function of it arrives,
# before any part runs), so no hook installed later sees them: a gloo backend's method,
# unbound, and a client of the rendezvous store with its methods bound.
_BACKEND_ALLREDUCE = dist.ProcessGroupGloo.allreduce
_STORE = (dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
          if "MASTER_PORT" in os.environ and "RANK" in os.environ else None)
_STORE_SET, _STORE_GET = (_STORE.set, _STORE.get) if _STORE is not None else (None, None)
_KEYS = itertools.count()


def hidden_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks of the default group, unseen by the recorder."""
    _BACKEND_ALLREDUCE(dist.group.WORLD._get_backend(torch.device("cpu")), [t]).wait()
    return t


def store_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks through the rendezvous store, unseen by any hook."""
    k, r, n = next(_KEYS), dist.get_rank(), dist.get_world_size()
    buf = io.BytesIO()
    torch.save(t.detach().clone(), buf)
    _STORE_SET(f"bypass/{k}/{r}", buf.getvalue())  # (a pool restarted has a new store)
    total = sum(torch.load(io.BytesIO(_STORE_GET(f"bypass/{k}/{q}"))).double() for q in range(n))
    return t.copy_(total.to(t.dtype))


def _run(parts: dict, rules, timeout_s: float = 20.0) -> dict:
    """Every part in one launch on 2 ranks (the shared pool)."""
    return H.run_all(parts, {}, {2: list(parts)}, timeout_s, "", rules)


_ALL_CHECKS: dict = {}  # each exercise's checks, as registered (before any test narrows them)


def _only(monkeypatch, nn, only) -> None:
    """Grade only the checks of exercise nn whose name holds one of `only`."""
    every = _ALL_CHECKS.setdefault(nn, list(G.checks_of(nn)))
    monkeypatch.setitem(G.CHECKS, nn, [c for c in every if any(o in c.name for o in only)])


def _grade_from(nn, checks, monkeypatch, results_attr, mine, overrides, only):
    """Grade exercise nn from `mine` (results of its parts), only the checks whose name
    holds one of `only`."""
    monkeypatch.setattr(checks, results_attr, lambda *a, **k: mine)
    _only(monkeypatch, nn, only)
    return G.grade(nn, reference=True, overrides=overrides)


def _failed(result) -> dict:
    return {c.name: c.message for c in result.checks if not c.ok}


# ---------------------------------------------------------------- 02: the ring

def rs_own_group(chunks):  # the reduce-scatter on a process group of its own
    g, r = dist.new_group(), dist.get_rank()
    full = torch.cat(chunks)
    dist.all_reduce(full, group=g)
    sizes = [len(c) for c in chunks]
    chunks[r].copy_(full[sum(sizes[:r]):sum(sizes[:r + 1])])


def ag_backend(chunks):  # the all-gather through the default group's backend object
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    for i, c in enumerate(chunks):
        opts = dist.BroadcastOptions()
        opts.rootRank = i
        backend.broadcast([c], opts).wait()


def ar_registered_op(tensor):  # torch's registered operator, no Python function in between
    out = torch.ops._c10d_functional.all_reduce(tensor, "sum", dist.group.WORLD.group_name)
    return tensor.copy_(torch.ops._c10d_functional.wait_tensor(out))


def ar_dummy_ring(tensor):  # the ring's messages, zeros in them; the sum unseen
    r, n = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(n))
    for k in range(2 * (n - 1)):
        send = chunks[(r - k) % n] if k < n - 1 else chunks[(r - k + 1) % n]
        recv = chunks[(r - k - 1) % n] if k < n - 1 else chunks[(r - k) % n]
        works = [dist.irecv(torch.empty_like(recv), (r - 1) % n), dist.isend(torch.zeros_like(send), (r + 1) % n)]
        for w in works:
            w.wait()
    return hidden_all_reduce(tensor)


def ar_store(tensor):  # no message at all: the sum through the store
    return store_sum(tensor)


def test_02_data_moved_any_other_way_scores_0_naming_it(monkeypatch):
    monkeypatch.setattr(C2, "WORLD_SIZES", (2,))
    r = G.grade("02", reference=True, overrides=dict(
        ring_reduce_scatter=rs_own_group, ring_all_gather=ag_backend, all_reduce=ar_registered_op))
    failed = _failed(r)
    assert r.points == 0, failed
    for name, msg in failed.items():
        assert "this part scores 0" in msg, msg
        if "ring_reduce_scatter" in name:
            assert "a process group of your own" in msg or "did not hand out" in msg, msg
        elif "ring_all_gather" in name:
            assert "backend object" in msg, msg
        else:
            assert "c10d allreduce_" in msg, msg


def test_02_a_sum_that_no_message_carried_scores_0_on_the_all_reduce_checks(monkeypatch):
    monkeypatch.setattr(C2, "WORLD_SIZES", (2,))
    for fn in (ar_dummy_ring, ar_store):
        r = G.grade("02", reference=True, overrides=dict(all_reduce=fn))
        failed = _failed(r)
        assert set(failed) == {c.name for c in r.checks if "ring_" not in c.name}, (fn, failed)
        for msg in failed.values():
            assert ("no message from the left neighbour brought" in msg
                    or "sent 0 bytes" in msg), (fn, msg)


# ---------------------------------------------------------------- 03: buckets

class OwnGroupDDP(DDP):  # the buckets all-reduced on a group of its own
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module, bucket_cap_mb, group=dist.new_group())


class HiddenDDP(DDP):  # each bucket's all-reduce carries zeros; the sum travels unseen
    def _launch_ready(self):
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            bucket = self.buckets[self._next]
            bucket.work = dist.all_reduce(torch.zeros_like(bucket.buffer), async_op=True)
            hidden_all_reduce(bucket.buffer)
            self._next += 1


def _03(cls, part, fns, r, n):
    return C3.PARTS[part]({"BucketedDDP": cls}, r, n)


def test_03_gradients_averaged_outside_the_recorded_all_reduces_score_0(monkeypatch):
    parts = {f"{cls.__name__}|{p}": functools.partial(_03, cls, p)
             for cls in (OwnGroupDDP, HiddenDDP) for p in ("several",)}
    results = _run(parts, C3.RULES)
    monkeypatch.setattr(C3, "WORLD_SIZES", (2,))
    for cls, phrase in ((OwnGroupDDP, "of your own"), (HiddenDDP, "carried bucket")):
        mine = {("several", 2): results[f"{cls.__name__}|several", 2]}
        r = _grade_from("03", C3, monkeypatch, "_results", mine, dict(BucketedDDP=cls),
                        ("several buckets", "overlap"))
        failed = _failed(r)
        assert any("several buckets" in n for n in failed), (cls, failed)
        for msg in failed.values():
            assert phrase in msg or "no all-reduce of this backward" in msg, (cls, msg)


# ---------------------------------------------------------------- 04: the token count

def acc_count_through_store(model, micro_batches, world_size, ddp=None):
    n = store_sum(torch.tensor([float(sum(int((y != -1).sum()) for _, y in micro_batches))]))
    total = torch.zeros(1)
    for i, (x, y) in enumerate(micro_batches):
        ctx = ddp.no_sync() if ddp is not None and i < len(micro_batches) - 1 else _null()
        with ctx:
            _, loss = model(x, y, reduction="sum")
            (loss * world_size / n).backward()
        total += loss.detach()
    return (store_sum(total) / n).item()


def acc_own_group(model, micro_batches, world_size, ddp=None):  # all-reduces on its own group
    g = dist.new_group()
    n = torch.tensor([float(sum(int((y != -1).sum()) for _, y in micro_batches))])
    dist.all_reduce(n, group=g)
    total = torch.zeros(1)
    for i, (x, y) in enumerate(micro_batches):
        ctx = ddp.no_sync() if ddp is not None and i < len(micro_batches) - 1 else _null()
        with ctx:
            _, loss = model(x, y, reduction="sum")
            (loss * world_size / n).backward()
        total += loss.detach()
    dist.all_reduce(total, group=g)
    return (total / n).item()


def _null():
    import contextlib
    return contextlib.nullcontext()


def _04(fn, part, fns, r, n):
    return C4.PARTS[part]({"accumulate": fn}, r, n)


def test_04_a_count_that_no_recorded_all_reduce_carried_scores_0(monkeypatch):
    monkeypatch.setattr(C4, "WORLD_SIZES", {2: ["plain", "ddp"]})
    fns = (acc_count_through_store, acc_own_group)
    parts = {f"{fn.__name__}|{p}": functools.partial(_04, fn, p) for fn in fns for p in ("plain", "ddp")}
    results = _run(parts, C4.RULES)
    for fn, phrase in ((acc_count_through_store, "not among the sums"),
                       (acc_own_group, "process group of your own")):
        mine = {(p, 2): results[f"{fn.__name__}|{p}", 2] for p in ("plain", "ddp")}
        r = _grade_from("04", C4, monkeypatch, "_results", mine, dict(accumulate=fn),
                        ("2 ranks", "mean loss"))
        failed = _failed(r)
        assert set(failed) == {c.name for c in r.checks}, (fn, failed)
        assert all(phrase in m for m in failed.values()), (fn, failed)


# ---------------------------------------------------------------- 05: the verdict

class StoreVerdict(PlainScaler):  # zeros all-reduced every step; the verdict through the store
    def _agree(self, flag):
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.MAX)
            return (store_sum(flag) > 0).float()
        return flag


class BackendVerdict(PlainScaler):  # the verdict through the backend object
    def _agree(self, flag):
        if dist.is_initialized() and dist.get_world_size() > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            dist.group.WORLD._get_backend(torch.device("cpu")).allreduce([flag], opts).wait()
        return flag


def _05(cls, fns, r, n):
    return C5._ranks_part({"LossScaler": cls}, r, n)


def test_05_a_verdict_that_travels_outside_the_recorded_collectives_scores_0(monkeypatch):
    results = _run({cls.__name__: functools.partial(_05, cls) for cls in (StoreVerdict, BackendVerdict)},
                   C5.RULES)
    for cls, phrase in ((StoreVerdict, "cannot have learnt of it"), (BackendVerdict, "backend object")):
        mine = {("ranks", 2): results[cls.__name__, 2], ("shards", 2): ("error", "not run here")}
        r = _grade_from("05", C5, monkeypatch, "_results", mine, dict(LossScaler=cls), ("2 ranks",))
        failed = _failed(r)
        assert len(failed) == 1 and phrase in next(iter(failed.values())), (cls, failed)


# ---------------------------------------------------------------- 06: ZeRO

class HiddenAverage(PlainZero):  # a reduce-scatter of zeros; the average computed unseen
    def _reduce_scatter(self, out, inp):
        dist.reduce_scatter_single(out, torch.zeros_like(inp), group=self.group)
        hidden_all_reduce(inp)
        out.copy_(inp[self.rank * out.numel():(self.rank + 1) * out.numel()] / self.world)
        return None


class OwnGroupZero(PlainZero):  # its collectives on a process group of its own
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = dist.new_group()


class HiddenState(PlainZero):  # the inner optimizer's state looks sharded; a full copy is kept
    @torch.no_grad()
    def step(self, closure=None):
        if not hasattr(self, "_full"):
            self._full = {id(p): [torch.zeros_like(p), torch.zeros_like(p)]
                          for u in self.units for p in u.params}
        for u in self.units:
            for p in u.params:
                if p.grad is not None:
                    m, v = self._full[id(p)]
                    m.lerp_(p.grad, 0.1)
                    v.lerp_(p.grad.square(), 0.05)
        return super().step(closure)


class KeepsGradients(PlainZero):  # stage 2 frees p.grad, but keeps a copy of every gradient
    @torch.no_grad()
    def _reduce(self, u):
        self.__dict__.setdefault("_kept", {})[id(u)] = u.flat_grads()
        super()._reduce(u)


class AllAtTheEnd(PlainZero):  # stage 2 reduces every unit after backward, in reverse order
    def _on_grad(self, p):
        stage, self.stage = self.stage, 1
        try:
            super()._on_grad(p)
        finally:
            self.stage = stage

    @torch.no_grad()
    def _end_of_backward(self):
        for u in reversed(self.units):
            self._reduce(u)
        self.finish_gradient_synchronization()


def _06(cls, part, fns, r, n):
    return C6.PARTS[part]({"ShardedOptimizer": cls}, r, n)


ZERO_CASES = {
    # class: (its parts, the checks it must fail, a phrase of each failure)
    HiddenAverage: (("zero2", "zero2_accum"), ("ZeRO-2 (reduce",), "not this rank's gradients"),
    OwnGroupZero: (("zero2", "zero2_accum"), ("ZeRO-2 (reduce",), "of your own"),
    HiddenState: (("zero1",), ("optimizer state",), "State kept anywhere"),
    KeepsGradients: (("zero2", "zero2_accum"), ("gradient memory",), "nor a copy of one"),
    AllAtTheEnd: (("order",), ("reduce order",), "unit index order"),
}


def test_06_data_moved_unseen_state_kept_aside_and_units_out_of_order_score_0(monkeypatch):
    parts = {"oracle": C6._oracle_part}
    for cls, (ps, _, _) in ZERO_CASES.items():
        parts.update({f"{cls.__name__}|{p}": functools.partial(_06, cls, p) for p in ps})
    results = _run(parts, C6.RULES)
    monkeypatch.setattr(C6, "WORLD_SIZES", (2,))
    for cls, (ps, checks, phrase) in ZERO_CASES.items():
        mine = {(p, 2): results[f"{cls.__name__}|{p}", 2] for p in ps}
        mine["oracle", 2] = results["oracle", 2]
        r = _grade_from("06", C6, monkeypatch, "_results", mine, dict(ShardedOptimizer=cls), checks)
        failed = _failed(r)
        assert set(failed) == {c.name for c in r.checks} and failed, (cls, failed)
        assert all(phrase in m for m in failed.values()), (cls, failed)


# ---------------------------------------------------------------- 07: Muon

class EveryoneComputes(PlainMuon):  # every rank orthogonalises every matrix; the state looks sharded
    @torch.no_grad()
    def step(self, closure=None):
        rank, world = self._world()
        hidden = self.__dict__.setdefault("_others", {})
        for p, g, owner in self._owned(world):
            send = torch.zeros(1 + p.numel(), dtype=self.ns_dtype)
            if p.grad is not None:
                if rank == owner:
                    update = self._update(p, g)
                    send[0], send[1:] = 1, update.flatten()
                else:  # the same work, its momentum kept out of self.state
                    buf = hidden.setdefault(id(p), torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - g["momentum"])
                    E7_ns(p.grad.lerp(buf, g["momentum"]), g["ns_steps"], self.ns_dtype)
            recv = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(recv, send, group=self.group)
            if recv[owner][0] == 1:
                self._apply(p, recv[owner][1:], g)


def E7_ns(*args):
    from minidist.muon import newton_schulz
    return newton_schulz(*args)


class HiddenUpdates(PlainMuon):  # all-gathers of zeros; the updates travel unseen
    @torch.no_grad()
    def step(self, closure=None):
        rank, world = self._world()
        for p, g, owner in self._owned(world):
            send = torch.zeros(1 + p.numel(), dtype=torch.float32)
            if rank == owner and p.grad is not None:
                send[0], send[1:] = 1, self._update(p, g).flatten().float()
            recv = [torch.empty(1 + p.numel(), dtype=self.ns_dtype) for _ in range(world)]
            dist.all_gather(recv, torch.zeros(1 + p.numel(), dtype=self.ns_dtype), group=self.group)
            hidden_all_reduce(send)
            if send[0] == 1:
                self._apply(p, send[1:].to(self.ns_dtype), g)


class OwnGroupMuon(PlainMuon):  # the updates all-gathered on a process group of its own
    @torch.no_grad()
    def step(self, closure=None):
        if self.group is None and self._world()[1] > 1:
            self.group = dist.new_group()
        return super().step(closure)


def _07(cls, part, fns, r, n):
    return C7.PARTS[part]({"Muon": cls}, r, n)


def test_07_work_and_momentum_on_every_rank_and_updates_moved_unseen_score_0(monkeypatch):
    cases = (  # (class, its parts, the checks it must fail, phrases of their messages)
        (EveryoneComputes, ("full",), ("Newton-Schulz only on its owner",), ("can reach hold",)),
        (HiddenUpdates, ("full", "missing"), ("every rank's parameters ==", "some gradients None"),
         ("reaches the other ranks by all_gather",)),
        (OwnGroupMuon, ("full",), ("every rank's parameters ==",), ("of your own",)))
    parts = {f"{cls.__name__}|{p}": functools.partial(_07, cls, p) for cls, ps, _, _ in cases for p in ps}
    results = _run(parts, C7.RULES)
    monkeypatch.setattr(C7, "WORLD_SIZES", (2,))
    for cls, ps, checks, phrases in cases:
        mine = {(p, 2): results[f"{cls.__name__}|{p}", 2] for p in ps}
        r = _grade_from("07", C7, monkeypatch, "_results", mine, dict(Muon=cls, newton_schulz=plain_ns),
                        checks)
        failed = _failed(r)
        assert set(failed) == {c.name for c in r.checks} and failed, (cls, failed)
        assert all(any(p in m for p in phrases) for m in failed.values()), (cls, failed)
    # the work, counted where it happens: every rank's FLOPs are those of every matrix
    per_rank = results["EveryoneComputes|full", 2][1]
    problem = C7._work_problem(2, per_rank, frozenset())
    assert problem and "orthogonalised them all" in problem, problem


NS_BORROWED = {
    "an alias": "\nnewton_schulz = ns_reference\n",
    "a wrapper": ("\n\ndef newton_schulz(G, steps=5, dtype=torch.bfloat16, eps=1e-7):\n"
                  "    return ns_reference(G, steps, dtype, eps)\n"),
}


@pytest.mark.parametrize("how", list(NS_BORROWED))
def test_07a_minidists_newton_schulz_scores_0_in_part_a(how, tmp_path, monkeypatch):
    # the learner's own file (graded as a learner's is), checked only on two of part (a)'s checks
    from test_grader_safety import _learner
    _learner(tmp_path, monkeypatch, "07", NS_BORROWED[how])
    _only(monkeypatch, "07", ("fp32: each singular", "bit for bit torch"))
    r = G.grade("07")
    assert r.points == 0 and len(r.checks) == 2
    for c in r.checks:
        assert "minidist.muon.orthogonalize.newton_schulz was called" in c.message and "part (a)" in c.message, c.message


# ---------------------------------------------------------------- 10 and 11: on the grader's group

from exercises import checks_10 as C10  # noqa: E402
from exercises import checks_11 as C11  # noqa: E402
from test_exercise_10 import PLAIN as PLAIN10, PlainColumn, PlainMLP, PlainRow  # noqa: E402
from test_exercise_11 import PLAIN as PLAIN11  # noqa: E402


class _FOwnGroup(torch.autograd.Function):  # f whose backward sums on a group of its own
    @staticmethod
    def forward(ctx, x, group):
        ctx.own = dist.new_group(dist.get_process_group_ranks(group))
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.own)
        return grad, None


def f_own_group(x, group):
    return _FOwnGroup.apply(x, group)


class ColumnOwnGroup(PlainColumn):
    f = staticmethod(f_own_group)


class RowThroughBackend(PlainRow):  # g's sum through the group's backend object
    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight).clone()
        self.group._get_backend(torch.device("cpu")).allreduce([y]).wait()
        return y if self.bias is None else y + self.bias


class _GHidden(torch.autograd.Function):  # g: zeros all-reduced on the group, the sum unseen
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(torch.zeros_like(x), group=group)
        return hidden_all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def g_hidden(x, group):
    return _GHidden.apply(x, group)


def test_10_a_group_of_its_own_a_backend_object_or_a_sum_moved_unseen_scores_0(monkeypatch):
    monkeypatch.setattr(C10, "WORLD_SIZES", (2,))
    _only(monkeypatch, "10", ("ColumnParallelLinear:", "RowParallelLinear:", "f and g"))
    r = G.grade("10", overrides={**PLAIN10, "ColumnParallelLinear": ColumnOwnGroup,
                                 "RowParallelLinear": RowThroughBackend, "reduce_from_region": g_hidden})
    failed = _failed(r)
    assert r.points == 0 and len(failed) == 3, failed
    for name, msg in failed.items():
        want = ("of your own" if "Column" in name else "backend object" if "Row" in name else
                "none of its all-reduces on the group carried")
        assert want in msg, (name, msg)


class _ZerosSummed(torch.autograd.Function):
    """y, after an all-reduce of zeros of its shape on the group, forward and backward: the
    collectives the check counts, carrying nothing."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        z = torch.zeros_like(y)
        dist.all_reduce(z, group=group)
        return y + z

    @staticmethod
    def backward(ctx, g):
        z = torch.zeros_like(g)
        dist.all_reduce(z, group=ctx.group)
        return g + z, None


def _conv_linear(x, w, b=None):  # a linear layer as a 1x1 convolution
    return torch.nn.functional.conv1d(x.transpose(1, 2), w.unsqueeze(-1), b).transpose(1, 2)


class MLPCarryingZeros(PlainMLP):
    """The shards as parameters, but the whole MLP computed from full weights kept in a
    plain list, as convolutions; the all-reduces carry zeros."""

    def __init__(self, full, group):
        super().__init__(full, group)
        self.group, self.full = group, [t.detach().clone() for t in (full.c_fc.weight, full.c_fc.bias,
                                                                      full.c_proj.weight, full.c_proj.bias)]

    def forward(self, x):
        wf, bf, wp, bp = self.full
        y = _conv_linear(torch.nn.functional.gelu(_conv_linear(x, wf, bf), approximate="tanh"), wp, bp)
        return _ZerosSummed.apply(y, self.group)


class MLPCheckedByConvolution(PlainMLP):
    """The plain tensor-parallel MLP, whose output every rank also computes in full (as
    convolutions, from full weights kept aside) to compare: every rank does all the work."""

    def __init__(self, full, group):
        super().__init__(full, group)
        self.full = [t.detach().clone() for t in (full.c_fc.weight, full.c_fc.bias,
                                                  full.c_proj.weight, full.c_proj.bias)]

    def forward(self, x):
        y = super().forward(x)
        wf, bf, wp, bp = self.full
        whole = _conv_linear(torch.nn.functional.gelu(_conv_linear(x.detach(), wf, bf), approximate="tanh"), wp, bp)
        assert torch.allclose(y, whole, atol=1e-5)
        return y


@pytest.mark.parametrize("mlp, says", [(MLPCarryingZeros, "none of its all-reduces on the group carried"),
                                        (MLPCheckedByConvolution, "matrix-multiply FLOPs")],
                         ids=["zeros-carried", "convolutions"])
def test_10_an_mlp_whose_work_is_not_split_scores_0_on_communication_and_work(mlp, says, monkeypatch):
    monkeypatch.setattr(C10, "WORLD_SIZES", (2,))
    _only(monkeypatch, "10", ("communication and work",))
    r = G.grade("10", overrides={**PLAIN10, "ParallelMLP": mlp})
    failed = _failed(r)
    assert r.points == 0 and len(failed) == 1, failed
    assert says in next(iter(failed.values())), failed


def schedule_through_backend(run, m):  # GPipe, its messages posted on the group's backend object
    backend = run.group._get_backend(torch.device("cpu"))
    for i in range(m):  # GPipe, each message through the backend
        if run.prev is not None:
            backend.recv([run.new_input(i)], dist.get_group_rank(run.group, run.prev), 0).wait()
        run.forward(i)
        if run.next is not None:
            backend.send([run.output(i)], dist.get_group_rank(run.group, run.next), 0).wait()
    for j in range(m):
        if run.next is not None:
            backend.recv([run.new_output_grad(j)], dist.get_group_rank(run.group, run.next), 1).wait()
        run.backward(j)
        if run.prev is not None:
            backend.send([run.input_grad(j)], dist.get_group_rank(run.group, run.prev), 1).wait()


_SCHEDULES = itertools.count()  # every stage runs the same schedules, in the same order


def schedule_through_store(run, m):  # GPipe whose activations and gradients go through the store
    c = next(_SCHEDULES)
    for i in range(m):
        if run.prev is not None:
            run.new_input(i).copy_(_take(f"pp/{c}/a{i}"))
        run.forward(i)
        if run.next is not None:
            _put(f"pp/{c}/a{i}", run.output(i))
    for j in range(m):
        if run.next is not None:
            run.new_output_grad(j).copy_(_take(f"pp/{c}/g{j}"))
        run.backward(j)
        if run.prev is not None:
            _put(f"pp/{c}/g{j}", run.input_grad(j))


def _put(key, t):
    buf = io.BytesIO()
    torch.save(t.detach().clone(), buf)
    _STORE_SET(key, buf.getvalue())


def _take(key):
    return torch.load(io.BytesIO(_STORE_GET(key)))


def test_11_messages_through_the_backend_or_the_store_score_0(monkeypatch):
    monkeypatch.setattr(C11, "WORLD_SIZES", (2,))
    monkeypatch.setattr(C11, "M_GRID", (2,))
    r = G.grade("11", overrides={**PLAIN11, "one_f_one_b": schedule_through_backend,
                                 "draft_one_f_one_b": schedule_through_store})
    failed = _failed(r)
    assert r.points == 0, failed
    for name, msg in failed.items():
        if "find the bug" in name:  # no message at all: the links carried nothing
            assert "message" in msg, msg
        else:
            assert "backend object" in msg, (name, msg)


# ---------------------------------------------------------------- 08: checkpoints

def save_gathering(root, step, model, opt):  # the model gathered on every rank, then saved
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [p.detach().clone() for p in model.parameters()])
    return C8.reference_save(root, step, model, opt)


def save_through_store(root, step, model, opt):  # the ranks agree through the store
    dist.distributed_c10d._get_default_store().set(f"saved/{step}", b"1")
    return C8.reference_save(root, step, model, opt)


def _08(fn, root, fns, r, n):
    return C8._save_part(fn.__name__, 2, root, {"save": fn}, r, n)


def test_08_save_that_gathers_the_model_or_uses_the_store_scores_0(monkeypatch, tmp_path):
    results = _run({fn.__name__: functools.partial(_08, fn, str(tmp_path))
                    for fn in (save_gathering, save_through_store)}, C8.RULES)
    _only(monkeypatch, "08", ("writes each element once",))
    for fn, phrase in ((save_gathering, "no rank gathers the model"), (save_through_store, "store")):
        monkeypatch.setattr(C8, "_part", lambda impl, name, fn=fn: next(
            per for _, per in H.per_world_size(results, fn.__name__, (2,))))
        r = G.grade("08", reference=True, overrides=dict(save=fn))
        assert r.points == 0 and phrase in r.checks[0].message, (fn, r.checks[0].message)


# ---------------------------------------------------------------- 09: activation memory

class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, x, stash, *params):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            y = fn(x)
        ctx.kept = y.detach().clone() if stash else None  # on the context: in no saved tensor
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        params = list(ctx.fn.__self__.parameters())
        with torch.enable_grad():
            y = ctx.fn(x)
        grads = torch.autograd.grad(y, [x, *params], grad, allow_unused=True)
        return (None, grads[0], None, *grads[1:])


_STASHED: list = []


def ckpt_ctx_stash(fn, x):  # saves only x, and keeps the output on the Function's context
    return _Recompute.apply(fn, x, True, *fn.__self__.parameters())


def ckpt_global_stash(fn, x):  # saves only x, and keeps a copy of the output in a global
    y = _Recompute.apply(fn, x, False, *fn.__self__.parameters())
    with torch.no_grad():
        _STASHED.append(fn(x).clone())
    return y


def ckpt_own_hooks(fn, x):  # no recomputation; its own saved-tensor hooks hide what is kept
    kept = {}

    def pack(t):
        kept[len(kept)] = t
        return len(kept) - 1
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda k: kept[k]):
        return fn(x)


@pytest.mark.parametrize("fn", [ckpt_ctx_stash, ckpt_global_stash, ckpt_own_hooks])
def test_09_activations_kept_out_of_sight_score_0_on_memory(fn, monkeypatch):
    _only(monkeypatch, "09", ("memory",))
    r = G.grade("09", reference=True, overrides=dict(checkpoint=fn))
    assert r.points == 0 and "times its input" in r.checks[0].message, r.checks[0].message


# ---------------------------------------------------------------- hints stop short of the answer

_STATEMENT = r"\b[\w.\[\]']+ (=|\+=|-=) [\w(\[]"


def test_the_last_hint_of_every_check_stops_short_of_the_finished_code():
    # a hint may show one call or one formula; a tier of statements is the answer itself,
    # which is the separate, explicit --reference command
    import re
    for nn in G.available():
        for c in _ALL_CHECKS.setdefault(nn, list(G.checks_of(nn))):
            hints = G.hints_of(nn, c)
            if hints:
                code = re.findall(_STATEMENT, hints[-1])
                assert len(code) <= 1, (nn, c.name, hints[-1])
