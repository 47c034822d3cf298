"""Exercise 06's grader catches the classic mistakes of a sharded optimizer, each in the
checks it belongs to, and a solution written the way the exercise asks scores full.

(tests/test_exercises.py proves that the stub scores 0 and minidist scores full, on 2
and 3 ranks.) Each process start costs seconds here, so the same 2 ranks (the shared
pool) run every part of the grader for the plain solution and for every mistake; each is
then graded from its share of the results, as the grader would grade it on 2 ranks. The mistakes
are the plain solution with one piece changed. The classes live at module level:
cloudpickle ships them to the ranks by name.
"""

import importlib

import pytest
import torch
import torch.distributed as dist

from exercises import checks_06 as C6
from exercises import grade as G
from grading_helpers import assert_keys_name_each_check_once, failed_checks
from minidist import comm

E6 = importlib.import_module("exercises.06_zero")  # its name starts with a digit


# -- 0. a plain solution, written the way the exercise asks (its scaffold, its hints)

class Plain(E6.ShardedOptimizer):
    def _shard_param_groups(self, groups):
        out = []
        for i, g in enumerate(groups):
            views = []
            for u in self.units:
                if i in u.ranges:
                    a, b = u.ranges[i]
                    v = u.shard[a:b]
                    v.grad = u.grad_shard[a:b]
                    views.append(v)
            if not views:
                v = torch.zeros(0)
                v.grad = torch.zeros(0)
                views = [v]
            out.append({**{k: x for k, x in g.items() if k != "params"}, "params": views})
        return out

    def _take_local_gradients(self):
        for u in self.units:
            u.grad_shard.copy_(u.flat_grads()[u.lo:u.hi])

    def _all_gather(self, out, inp):
        if self.collectives == "minidist":
            comm.all_gather(out, inp.clone())
            return None
        return dist.all_gather_single(out, inp, group=self.group, async_op=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure else None
        if not self.reduce_gradients:
            self._take_local_gradients()
        self.optim.step()
        self._gather_all()
        return loss

    def _gather_all(self):
        works = [self._all_gather(u.flat, u.shard) for u in self.units]
        for w in works:
            if w is not None:
                w.wait()

    def zero_grad(self, set_to_none=True):
        for u in self.units:
            u.grad_shard.zero_()
            for p in u.params:
                p.grad = None

    def _reduce_scatter(self, out, inp):
        if self.collectives == "minidist":
            comm.reduce_scatter(out, inp, op="avg")
            return None
        return dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG, group=self.group,
                                          async_op=True)

    def _on_grad(self, p):
        if self._no_sync:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued, self._next = True, 0
        self._unit_of[p].ready += 1
        # in unit index order: a complete unit waits for the ones before it
        while (self.stage == 2 and self._next < len(self.units)
               and self.units[self._next].ready == len(self.units[self._next].params)):
            self._reduce(self.units[self._next])
            self._next += 1

    @torch.no_grad()
    def _reduce(self, u):
        flat = u.flat_grads()
        self._free(u)
        out = torch.empty_like(u.grad_shard)
        self._pending.append((u, out, self._reduce_scatter(out, flat)))

    def _free(self, u):
        for p in u.params:
            p.grad = None

    @torch.no_grad()
    def _end_of_backward(self):
        for u in self.units[self._next if self.stage == 2 else 0:]:
            self._reduce(u)
        self.finish_gradient_synchronization()

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        for u, out, work in self._pending:
            if work is not None:
                work.wait()
            u.grad_shard += out
        self._pending.clear()
        for u in self.units:
            u.ready = 0
        self._queued = False


# -- the mistakes: one piece of the plain solution changed

class AllReduce(Plain):  # all-reduce the whole flat gradient, keep this rank's slice
    @torch.no_grad()
    def _reduce(self, u):
        flat = u.flat_grads()
        self._free(u)
        work = None
        if self.collectives == "minidist":
            comm.all_reduce(flat, op="avg")
        else:
            work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self._pending.append((u, flat[u.lo:u.hi], work))


class AsTheyComplete(Plain):  # stage 2 starts each unit as soon as it is complete
    def _on_grad(self, p):
        if self._no_sync:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued, self._next = True, 0
        u = self._unit_of[p]
        u.ready += 1
        if self.stage == 2 and u.ready == len(u.params):
            self._reduce(u)

    @torch.no_grad()
    def _end_of_backward(self):
        for u in self.units:
            if self.stage == 1 or u.ready < len(u.params):
                self._reduce(u)
        self.finish_gradient_synchronization()


class NoAllGather(Plain):  # each rank steps its shard; the others' updates never arrive
    def _gather_all(self):
        pass


class Sums(Plain):  # the reduce-scatter sums over ranks
    def _reduce_scatter(self, out, inp):
        if self.collectives == "minidist":
            comm.reduce_scatter(out, inp, op="sum")
            return None
        return dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=self.group,
                                          async_op=True)


class NeverFrees(Plain):  # the full gradients stay, and the next micro-step adds to them
    def _free(self, u):
        pass


class FreesAtEnd(Plain):  # right gradients, but every full gradient lives until backward ends
    def _free(self, u):
        pass

    @torch.no_grad()
    def _end_of_backward(self):
        super()._end_of_backward()
        for u in self.units:
            Plain._free(self, u)


class FullInner(Plain):  # ZeroRedundancyOptimizer's contract, on an unsharded inner optimizer
    def _shard_param_groups(self, groups):
        if self.reduce_gradients:
            return super()._shard_param_groups(groups)
        return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]

    def _take_local_gradients(self):
        pass  # the inner optimizer reads p.grad, already averaged, whole


class NoPlaceholder(Plain):  # a group with no element on this rank is left out
    def _shard_param_groups(self, groups):
        return [g for g in super()._shard_param_groups(groups) if g["params"][0].numel()]


class IgnoresNoSync(Plain):  # stage 1 reduces every micro-step: right sums, twice the bytes
    def _on_grad(self, p):
        self._no_sync = False
        super()._on_grad(p)


class DelegatesToTorch(Plain):  # stage 1's contract handed to torch's ZeroRedundancyOptimizer
    def __init__(self, params, optimizer_class, group=None, stage=1, reduce_gradients=False,
                 **kwargs):
        params = list(params)
        super().__init__(params, optimizer_class, group, stage, reduce_gradients, **kwargs)
        if stage == 1 and not reduce_gradients:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            self._torch = ZeroRedundancyOptimizer([p for u in self.units for p in u.params],
                                                  optimizer_class)


# The checks of exercise 06, by a word of their names.
CHECK6 = {"zero1": "gradients averaged beforehand", "torch": "ZeroRedundancyOptimizer (2 ranks",
          "state": "optimizer state", "reduce": "reduce_gradients=True", "zero2": "ZeRO-2 (reduce",
          "grad memory": "gradient memory", "bytes": "bytes on the wire",
          "accumulator": "find the bug", "order": "reduce order"}

MISTAKES6 = {
    # name: (class, checks that must fail, a phrase each failure message contains)
    "all-reduce instead of reduce-scatter": (AllReduce, {"bytes"}, "all-reduce"),
    "no all-gather after the step": (NoAllGather, {"zero1", "torch", "reduce", "zero2", "bytes"},
                                     "all-gather"),
    "sums instead of averaging": (Sums, {"reduce", "zero2"}, "times too large"),
    "stage 2 never frees the full gradients": (NeverFrees, {"zero2", "grad memory"}, "p.grad"),
    "stage 2 frees them only when backward ends": (FreesAtEnd, {"grad memory"}, "at the end of backward"),
    "inner optimizer on the full parameters": (FullInner, {"state"}, "whole model"),
    "empty group left out": (NoPlaceholder, {"zero1"}, "placeholder"),
    "stage 1 ignores no_sync": (IgnoresNoSync, {"bytes"}, "no_sync"),
    "stage 2 reduces units as they complete": (AsTheyComplete, {"order"}, "unit index order"),
    "torch's ZeroRedundancyOptimizer inside": (
        DelegatesToTorch, {"zero1", "torch", "state"},
        "ZeroRedundancyOptimizer was called, which this exercise forbids"),
}
SOLUTIONS = {"plain": Plain, **{k: v[0] for k, v in MISTAKES6.items()}}


def _on_ranks(cls, part, fns, r, n):
    return C6.PARTS[part]({"ShardedOptimizer": cls}, r, n)


def _accumulator_on_ranks(cls, fns, r, n):
    return C6._accumulator_part({"ShardedGradAccumulator": cls}, r, n)


@pytest.fixture(scope="module")
def shared():
    """Every part, for the plain solution and every mistake, on the same 2 ranks (one
    shared pool, no process started per solution): one run of the grader's harness per
    solution, as the grader runs one per implementation. (One run for all of them cost
    twice as much: after each part the harness writes everything its run has finished so
    far, so the writes grow with the square of the parts in one run.)"""
    import functools
    runs = [{"oracle": C6._oracle_part,  # and the find-the-bug part, fixed and as shipped
             "accumulator": functools.partial(_accumulator_on_ranks, C6.ReferenceGradAccumulator),
             "shipped accumulator": functools.partial(_accumulator_on_ranks, E6.ShardedGradAccumulator)}]
    for label, cls in SOLUTIONS.items():
        runs.append({f"{label}|{p}": functools.partial(_on_ranks, cls, p)
                     for p in C6.PLAN[2] if p != "oracle" and _runs(label, p)})
    results = {}
    for parts in runs:
        results.update(C6.H.run_all(parts, {}, {2: list(parts)}, C6.TIMEOUT_S, C6.HANG_HINT, C6.RULES))
    return results


# the reduce order is the plain solution's but for the solution that changes only it, which
# changes nothing else: each runs only its own parts (seconds saved), the plain's stand in
ORDER_ONLY = "stage 2 reduces units as they complete"


def _runs(label: str, part: str) -> bool:
    return label == "plain" or (part == "order") == (label == ORDER_ONLY)


def _grade(label, shared, monkeypatch):
    mine = {(p, 2): shared[f"{label if _runs(label, p) else 'plain'}|{p}" if p != "oracle" else p, 2]
            for p in C6.PLAN[2]}
    mine["accumulator", 2] = shared["accumulator", 2]
    monkeypatch.setattr(C6, "WORLD_SIZES", (2,))
    monkeypatch.setattr(C6, "_results", lambda impl: mine)
    return G.grade("06", overrides=dict(ShardedOptimizer=SOLUTIONS[label]))


def _failed(result):
    return failed_checks(result, CHECK6)


def test_06_check_keys_name_each_check_once():
    assert_keys_name_each_check_once("06", CHECK6)


def test_06_a_plain_solution_scores_full(shared, monkeypatch):
    r = _grade("plain", shared, monkeypatch)
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


@pytest.mark.parametrize("mistake", list(MISTAKES6))
def test_06_mistake_loses_the_points_of_its_checks(mistake, shared, monkeypatch):
    _, must_fail, phrase = MISTAKES6[mistake]
    r = _grade(mistake, shared, monkeypatch)
    which, messages = _failed(r)
    assert which == must_fail, messages
    assert 0 < r.points < r.max_points
    for name, msg in messages.items():
        assert phrase in msg and "not implemented" not in msg, (name, msg)


def test_06_the_stub_is_graded_without_starting_processes(monkeypatch):
    # only the find-the-bug part, shipped code, goes to the ranks
    plans = []

    def launch(parts, fns, plan, *a, **k):
        plans.append(plan)
        return {("accumulator", 2): ("error", "not run in this test")}
    monkeypatch.setattr(C6.H, "run_all", launch)
    r = G.grade("06")
    assert plans == [{2: ["accumulator"]}] and r.points == 0
    assert all(c.message.startswith("not implemented: ") for c in r.checks
               if CHECK6["accumulator"] not in c.name)


def test_06_the_shipped_accumulator_keeps_only_the_last_micro_step(shared, monkeypatch):
    monkeypatch.setattr(C6, "WORLD_SIZES", (2,))
    monkeypatch.setattr(C6, "_results", lambda impl: {("accumulator", 2): shared["shipped accumulator", 2]})
    monkeypatch.setitem(G.CHECKS, "06", [c for c in G.checks_of("06") if CHECK6["accumulator"] in c.name])
    r = G.grade("06")
    assert r.points == 0 and "only the last micro-step" in r.checks[0].message, r.checks[0].message


def test_06_the_layout_written_out_is_minidists():
    # the expected sizes come from _layout; minidist's units, built in this process as
    # rank r of n (construction needs no process group), must have the same shape; and
    # the third param group is missing from some rank's shards
    from unittest import mock

    from minidist.zero import ShardedOptimizer
    for n in (2, 3):
        lay = C6._layout(n)
        assert (lay["padded"] > lay["psi"]) == (n == 3) and lay["units"] > 3
        held = []
        for r in range(n):
            with mock.patch.object(dist, "get_rank", lambda group=None: r), \
                    mock.patch.object(dist, "get_world_size", lambda group=None: n):
                model = C6._model()
                opt = ShardedOptimizer(C6._groups(model), C6._NoOptimizer, bucket_cap_mb=C6.CAP_MB,
                                       module=model)
            assert sum(u.flat.numel() for u in opt.units) == lay["padded"]
            assert len(opt.units) == lay["units"]
            assert sum(b - a for u in opt.units for a, b in u.ranges.values()) == lay["owned"][r]
            held.append({g for u in opt.units for g in u.ranges})
        assert any(2 not in groups for groups in held)  # a rank needs a placeholder group


def test_06_every_check_has_hints():
    assert all(G.hints_of("06", c) for c in G.checks_of("06"))
