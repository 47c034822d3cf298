"""Exercises 03 and 04's graders catch the classic mistakes, each in the checks it belongs
to, a solution written the way the exercise asks scores full, and a hang fails its checks
instead of hanging the grader.

(tests/test_exercises.py proves for every exercise that the stubs score 0 and minidist
scores full.) Exercise 03's mistakes run on 2 ranks only (the grader itself runs 2 and 3).
The mistaken implementations live at module level: cloudpickle ships them to the ranks by
name.
"""

import contextlib
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from exercises import checks_03 as C3
from exercises import grade as G
from minidist.ddp import DDP, allreduce_gradients_naive, broadcast_module

EX3 = importlib.import_module("exercises.03_data_parallel")


# =====================================================================  exercise 03

# -- 0. a plain solution, written the way the exercise asks (its suggested structure)

def plain_make_buckets(module, bucket_cap_mb):
    cap = float("inf") if bucket_cap_mb is None else bucket_cap_mb * 2**20
    buckets, used = [], 0
    for p in reversed([p for p in module.parameters() if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if buckets and used + nbytes <= cap:
            buckets[-1].append(p)
            used += nbytes
        else:
            buckets.append([p])
            used = nbytes
    return buckets


def plain_bucket_by_dtype(module, bucket_cap_mb):
    # the shipped version with its set replaced by a list in reverse registration order
    by_dtype = {}
    for p in reversed([p for p in module.parameters() if p.requires_grad]):
        by_dtype.setdefault(p.dtype, []).append(p)
    return [b for params in by_dtype.values() for b in plain_make_buckets(_Listed(params), bucket_cap_mb)]


class _Listed:
    def __init__(self, params):
        self.params = params

    def parameters(self):  # plain_make_buckets reverses: hand it registration order
        return reversed(self.params)


class PlainDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)
        self.buckets = plain_make_buckets(module, bucket_cap_mb)
        self.buffers, self.views, self.where = [], [], {}
        for b, params in enumerate(self.buckets):
            buf = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
            views, off = [], 0
            for i, p in enumerate(params):
                views.append(buf[off:off + p.numel()].view_as(p))
                self.where[p] = (b, i)
                off += p.numel()
            self.buffers.append(buf)
            self.views.append(views)
        self._reset()
        for params in self.buckets:
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.ready = [set() for _ in self.buckets]
        self.works = [None] * len(self.buckets)
        self.next, self.queued = 0, False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _launch(self):
        while self.next < len(self.buckets) and len(self.ready[self.next]) == len(self.buckets[self.next]):
            self.works[self.next] = dist.all_reduce(self.buffers[self.next], async_op=True)
            self.next += 1

    @torch.no_grad()
    def _grad_ready(self, p):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b, i = self.where[p]
        self.views[b][i].copy_(p.grad)
        self.ready[b].add(i)
        self._launch()

    @torch.no_grad()
    def _end_of_backward(self):
        self._launch()
        for b, params in enumerate(self.buckets):
            self.works[b].wait()
            self.buffers[b].div_(dist.get_world_size())
            for p, v in zip(params, self.views[b]):
                p.grad.copy_(v)
        self._reset()


# -- 1. all-reduce sums: forgetting to divide by the world size

class SummingDDP(DDP):
    def finish_gradient_synchronization(self):
        was_queued = self._callback_queued
        super().finish_gradient_synchronization()
        if was_queued:
            for bucket in self.buckets:
                bucket.buffer.mul_(self.world)  # undo the average: the sum is left


# -- 2. every bucket all-reduced after backward: right numbers, no overlap

class AfterBackwardDDP(DDP):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module, bucket_cap_mb, overlap=False)


# -- 3. buckets launched from the hooks, but synchronously: backward waits for each

class _Done:
    def wait(self):
        pass


class BlockingDDP(DDP):
    def _launch_ready(self):
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            dist.all_reduce(self.buckets[self._next].buffer)  # async_op=False: blocks
            self.buckets[self._next].work = _Done()
            self._next += 1


# -- 4. the naive version: one all-reduce per parameter, at the end of backward

class PerParameterDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module, self.queued = module, False
        broadcast_module(module)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _hook(self, p):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self):
        allreduce_gradients_naive(self.module)
        self.queued = False


# -- 5. buckets in registration order (the order forward uses them, not backward)

def unreversed_make_buckets(module, bucket_cap_mb):
    return plain_make_buckets(_Reversed(module), bucket_cap_mb)


class _Reversed:
    def __init__(self, module):
        self.module = module

    def parameters(self):
        return reversed(list(self.module.parameters()))


# -- 5b. each bucket launched as soon as it fills, in whatever order backward fills them:
#        right numbers on one machine, but ranks may pair different buckets

class AsFilledDDP(DDP):
    def _launch_ready(self):
        for bucket in self.buckets:
            if bucket.work is None and len(bucket.ready) == len(bucket.params):
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self._next = len(self.buckets) if all(b.work is not None for b in self.buckets) else 0


# -- 5c. torch's DistributedDataParallel inside: its C++ reducer bypasses any Python
#        patch of the collectives, so the grader looks at what is built

class TorchDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        self.ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb or 25.0)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)


# -- 5d. the all-reduces right, the broadcast done with all_gather (a collective not allowed)

class GatherBroadcastDDP(DDP):
    def __init__(self, module, bucket_cap_mb=25.0):
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
                dist.all_gather(everyone, t.data.contiguous())
                t.data.copy_(everyone[0])
        super().__init__(module, bucket_cap_mb)


# -- 6. a hang: each rank waits for a message that nobody sends (gloo's timeout ends it)

class WaitsForeverDDP(DDP):
    def finish_gradient_synchronization(self):
        if self._callback_queued:
            r, n = dist.get_rank(), dist.get_world_size()
            dist.irecv(torch.empty(1), (r + 1) % n).wait()
        super().finish_gradient_synchronization()


# The checks of exercise 03, by a word of their names.
CHECK3 = {"buckets": "make_buckets", "construction": "construction", "several": "several buckets",
          "extremes": "one per parameter", "overlap": "overlap", "count": "one all_reduce per bucket",
          "order": "launch order", "dtype": "find the bug"}

MISTAKES3 = {
    # name: (overrides, checks that must fail, a phrase each failure message contains)
    "sums instead of averaging": (dict(BucketedDDP=SummingDDP), {"several", "extremes"}, "times too large"),
    "all-reduce after backward only": (dict(BucketedDDP=AfterBackwardDDP), {"overlap"}, "none overlapped"),
    "synchronous all-reduce in the hooks": (dict(BucketedDDP=BlockingDDP), {"overlap"}, "synchronous"),
    "one all-reduce per parameter, after backward": (
        dict(BucketedDDP=PerParameterDDP), {"overlap", "count", "order"}, "all_reduce"),
    "buckets not reversed": (dict(make_buckets=unreversed_make_buckets), {"buckets"}, "reverse registration order"),
    "buckets launched as they fill": (dict(BucketedDDP=AsFilledDDP), {"order"}, "Ranks pair collectives"),
    "torch's DDP inside": (dict(BucketedDDP=TorchDDP),
                           {"construction", "several", "extremes", "overlap", "count", "order"},
                           "DistributedDataParallel was called, which this exercise forbids"),
    "all_gather for the broadcast": (
        dict(BucketedDDP=GatherBroadcastDDP),
        {"construction", "several", "extremes", "overlap", "count", "order"},
        "dist.all_gather (ProcessGroup.allgather) was called, which this exercise forbids"),
    "bucket_by_dtype as shipped (a set)": (
        dict(bucket_by_dtype=EX3.bucket_by_dtype),
        {"dtype"}, "ranks would pair different buckets"),
}


def _failed(result, names):
    failed = {c.name: c.message for c in result.checks if not c.ok}
    return {k for k, v in names.items() if any(v in name for name in failed)}, failed


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(C3, "WORLD_SIZES", (2,))


def test_03_a_plain_solution_scores_full():
    # on 2 and 3 ranks, as the grader runs it for a student
    r = G.grade("03", overrides=dict(make_buckets=plain_make_buckets, BucketedDDP=PlainDDP,
                                     bucket_by_dtype=plain_bucket_by_dtype))
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


@pytest.mark.parametrize("mistake", list(MISTAKES3))
def test_03_mistake_loses_the_points_of_its_checks(mistake, two_ranks):
    overrides, must_fail, phrase = MISTAKES3[mistake]
    r = G.grade("03", reference=True, overrides=overrides)
    which, messages = _failed(r, CHECK3)
    assert which == must_fail, messages
    assert 0 < r.points < r.max_points
    for name, msg in messages.items():
        assert phrase in msg and "not implemented" not in msg, (name, msg)


def test_03_a_hang_fails_its_checks_within_the_timeout(two_ranks, monkeypatch):
    monkeypatch.setattr(C3, "TIMEOUT_S", 4.0)
    r = G.grade("03", reference=True, overrides=dict(BucketedDDP=WaitsForeverDDP))
    which, messages = _failed(r, CHECK3)
    # construction and make_buckets keep their points; the first training part hangs,
    # the parts after it are not run
    assert which == {"several", "extremes", "overlap", "count", "order"}, messages
    assert "timed out" in messages[next(n for n in messages if CHECK3["several"] in n)]
    assert all("timed out" in m or "hung" in m for m in messages.values()), messages
    # (WaitsForeverDDP never returns: that grading ended at all is the watchdog's doing)


def test_03_every_check_has_hints():
    assert all(G.hints_of("03", c) for c in G.checks_of("03"))


def test_03_results_are_cached_per_implementation(two_ranks, monkeypatch):
    runs = []
    real = C3.H.run_all
    monkeypatch.setattr(C3.H, "run_all", lambda *a, **k: runs.append(1) or real(*a, **k))
    G.grade("03", reference=True)
    G.grade("03", reference=True, overrides=dict(make_buckets=unreversed_make_buckets))  # same DDP
    assert len(runs) == 1
    # (a different BucketedDDP runs anew: the mistakes above would score full otherwise)


# =====================================================================  exercise 04

def _count(micro_batches):
    n = torch.tensor([float(sum(int((y != -1).sum()) for _, y in micro_batches))])
    dist.all_reduce(n)
    return n


def _sync(ddp, i, k):
    return contextlib.nullcontext() if ddp is None or i == k - 1 else ddp.no_sync()


# -- 0. a plain solution

def acc_plain(model, micro_batches, world_size, ddp=None):
    n, total = _count(micro_batches), torch.zeros(1)
    for i, (x, y) in enumerate(micro_batches):
        with _sync(ddp, i, len(micro_batches)):
            _, loss = model(x, y, reduction="sum")
            (loss * world_size / n).backward()
        total += loss.detach()
    dist.all_reduce(total)
    return (total / n).item()


# -- 1. the mean of per-micro-batch means

def acc_micro_means(model, micro_batches, world_size, ddp=None):
    k, total = len(micro_batches), torch.zeros(1)
    for i, (x, y) in enumerate(micro_batches):
        with _sync(ddp, i, k):
            _, loss = model(x, y)
            (loss / k).backward()
        total += loss.detach() / k
    dist.all_reduce(total)
    return (total / world_size).item()


# -- 2. no no_sync: right gradients, communication in every micro-step

def acc_no_no_sync(model, micro_batches, world_size, ddp=None):
    return acc_plain(model, micro_batches, world_size, None)


# -- 3. each rank normalises by its own token count

def acc_local_count(model, micro_batches, world_size, ddp=None):
    n, total = sum(int((y != -1).sum()) for _, y in micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        with _sync(ddp, i, len(micro_batches)):
            _, loss = model(x, y, reduction="sum")
            (loss / n).backward()
        total += loss.item()
    return total / n


# -- 4. the global count, but no world_size factor: DDP's average halves the gradient

def acc_no_world_factor(model, micro_batches, world_size, ddp=None):
    return acc_plain(model, micro_batches, 1, ddp)


CHECK4 = {"one rank": "1 rank", "ddp": "under DDP", "plain": "ddp=None", "loss": "mean loss",
          "no_sync": "no_sync"}

# -- a rule broken: the token count gathered with dist.all_gather, not all_reduce

def acc_gathers_count(model, micro_batches, world_size, ddp=None):
    mine = torch.tensor([float(sum(int((y != -1).sum()) for _, y in micro_batches))])
    everyone = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    n, total = sum(everyone), torch.zeros(1)
    for i, (x, y) in enumerate(micro_batches):
        with _sync(ddp, i, len(micro_batches)):
            _, loss = model(x, y, reduction="sum")
            (loss * world_size / n).backward()
        total += loss.detach()
    dist.all_reduce(total)
    return (total / n).item()


def test_04_a_collective_other_than_all_reduce_scores_0_naming_the_rule():
    r = G.grade("04", overrides=dict(accumulate=acc_gathers_count))
    assert r.points == 0
    assert all("dist.all_gather (ProcessGroup.allgather) was called, which this exercise "
               "forbids" in c.message for c in r.checks), [c.message for c in r.checks]


# -- a rule broken: with ddp=None it averages the gradients itself (right numbers, since
#    the caller's average of equal gradients changes nothing, but the rule says never)

def acc_averages_gradients(model, micro_batches, world_size, ddp=None):
    loss = acc_plain(model, micro_batches, world_size, ddp)
    if ddp is None:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
    return loss


def test_04_communicating_gradients_yourself_scores_0_on_those_parts():
    r = G.grade("04", overrides=dict(accumulate=acc_averages_gradients))
    which, messages = _failed(r, CHECK4)
    assert which == {"one rank", "plain", "loss"}, messages
    for name, msg in messages.items():
        assert "never communicates gradients itself" in msg, (name, msg)


MISTAKES4 = {
    "mean of micro-batch means": (acc_micro_means, {"one rank", "ddp", "plain", "loss"},
                                  "per-micro-batch means"),
    "no no_sync": (acc_no_no_sync, {"no_sync"}, "ddp.no_sync()"),
    "local token count": (acc_local_count, {"ddp", "plain", "loss"}, "rank"),
    "no world_size factor": (acc_no_world_factor, {"ddp", "plain"}, "0.5 times"),
}


def test_04_a_plain_solution_scores_full():
    r = G.grade("04", overrides=dict(accumulate=acc_plain))
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


@pytest.mark.parametrize("mistake", list(MISTAKES4))
def test_04_mistake_loses_the_points_of_its_checks(mistake):
    fn, must_fail, phrase = MISTAKES4[mistake]
    r = G.grade("04", overrides=dict(accumulate=fn))
    which, messages = _failed(r, CHECK4)
    assert which == must_fail, messages
    assert 0 < r.points < r.max_points
    for name, msg in messages.items():
        assert phrase in msg and "not implemented" not in msg, (name, msg)
