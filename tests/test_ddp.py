"""minidist.ddp.DDP against its oracles: one process on the full batch, and torch's own
DistributedDataParallel, on a model with a tied weight and a frozen parameter. The ranks
come from the session's process pools (tests/conftest.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.ddp import DDP


class Tied(nn.Module):
    """Embedding tied to the head, a frozen layer, and enough tensors for several buckets."""

    def __init__(self, V=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        h = self.body(self.frozen(self.emb(x)))
        return nn.functional.cross_entropy(self.head(h).view(-1, self.head.out_features), y.view(-1))


def _data(step, batch=8, T=6):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 50, (batch, T), generator=g)
    return x, x.roll(-1, 1)


def _train(model, opt_name, steps, rank=0, world=1, wrap=None):
    m = wrap(model) if wrap else model
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    for s in range(steps):
        x, y = _data(s)
        per = x.shape[0] // world
        m(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _one_process(opt_name):
    torch.manual_seed(0)
    return _train(Tied(), opt_name, 5)


def _ddp(opt_name, cap, torch_ddp=False):
    torch.manual_seed(dist.get_rank() + 100)  # ranks start different: DDP must broadcast
    model = Tied()
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = Tied()
    if torch_ddp:
        wrap = lambda m: nn.parallel.DistributedDataParallel(m)
    else:
        wrap = lambda m: DDP(m, bucket_cap_mb=cap)
    n_buckets = len(DDP(Tied(), bucket_cap_mb=cap).buckets) if not torch_ddp else None
    out = _train(model, opt_name, 5, dist.get_rank(), dist.get_world_size(), wrap)
    return out, n_buckets


# Trainable tensors in gradient order and their bytes: 64, 64, 64, 4096, 256, 4096, 3200
# (the tied embedding last, the frozen layer absent). So: one bucket (None); two (a cap
# of 8000 bytes: 4544 + 7296); five (4194 bytes); one per parameter (0).
@pytest.mark.parametrize("cap, buckets", [(None, 1), (8000 / 2**20, 2), (0.004, 5), (0, 7)])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_ddp_equals_one_process(opt_name, cap, buckets, pool):
    ref = _one_process(opt_name)
    for state, n_buckets in pool(2).run(_ddp, opt_name, cap):
        assert n_buckets == buckets
        for k in ref:
            torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def test_ddp_equals_torch_ddp_on_four_ranks(pool):
    ours = pool(4).run(_ddp, "adamw", 0.004)
    theirs = pool(4).run(_ddp, "adamw", None, True)
    for (a, _), (b, _) in zip(ours, theirs):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def _construction_broadcasts():
    torch.manual_seed(dist.get_rank())
    m = Tied()
    before = m.emb.weight.clone()
    DDP(m)
    everyone = [torch.empty_like(before) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, m.emb.weight.detach())
    return torch.equal(before, m.emb.weight), all(torch.equal(e, everyone[0]) for e in everyone)


def test_construction_makes_ranks_equal(pool):
    (kept0, equal0), (kept1, equal1) = pool(2).run(_construction_broadcasts)
    assert kept0 and not kept1 and equal0 and equal1


def _count_allreduces_under_no_sync(k):
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    torch.manual_seed(0)
    m = DDP(Tied(), bucket_cap_mb=0)
    per_micro = []
    for micro in range(k):
        x, y = _data(micro)
        if micro < k - 1:
            with m.no_sync():
                m(x, y).backward()
        else:
            m(x, y).backward()
        per_micro.append(len(calls))
    dist.all_reduce = real
    return per_micro, len(m.buckets)


def test_no_sync_communicates_only_at_the_boundary(pool):
    for per_micro, n_buckets in pool(2).run(_count_allreduces_under_no_sync, 3):
        assert per_micro == [0, 0, n_buckets]


def _unused(find):
    m = Tied()
    m.extra = nn.Linear(3, 3)  # never used in forward
    ddp = DDP(m, find_unused_parameters=find)
    x, y = _data(0)
    ddp(x, y).backward()
    return torch.count_nonzero(m.extra.weight.grad).item()


def test_unused_parameter_is_named_or_zero(pool):
    with pytest.raises(RuntimeError, match="extra.weight"):
        pool(2).run(_unused, False)
    assert pool(2).run(_unused, True) == [0, 0]


def _forward_decides():
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    torch.manual_seed(0)
    m = DDP(Tied(), bucket_cap_mb=None)
    x, y = _data(0)
    with m.no_sync():
        loss = m(x, y)
    loss.backward()  # outside the context, but its forward was inside: no communication
    quiet = len(calls)
    m(x, y).backward()
    dist.all_reduce = real
    return quiet, len(calls)


def test_the_forward_decides_like_torch_ddp(pool):
    assert pool(2).run(_forward_decides) == [(0, 1), (0, 1)]


def _train_through_the_interface(kinds, steps=3, clip=0.05):
    """The loop train_gpt runs, written once for every kind: the forward on the bare model,
    two micro-steps (the first in no_sync()), finish_gradient_synchronization(), then
    clip_grad_norm_(). Counts the all-reduces issued during the first micro-step."""
    from minidist.ddp import FlatDDP, NaiveDDP
    make = {"naive": NaiveDDP, "flat": FlatDDP, "bucketed": lambda m: DDP(m, bucket_cap_mb=0.004),
            None: None}
    r, n = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = Tied()
        sync = make[kind](model) if kind else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        calls, real = [], dist.all_reduce
        norms, quiet = [], []
        for s in range(steps):
            x, y = _data(s)
            per = x.shape[0] // n
            x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                if i == 0 and sync is not None:
                    dist.all_reduce = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
                    with sync.no_sync():
                        (model(xm, ym) / 2).backward()  # the bare model, even under DDP
                    dist.all_reduce = real
                    quiet.append(len(calls))
                else:
                    (model(xm, ym) / 2).backward()
            if sync is not None:
                sync.finish_gradient_synchronization()
                norms.append(float(sync.clip_grad_norm_(clip)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[kind] = ({k: v.clone() for k, v in model.state_dict().items()}, norms, quiet)
    return out


def test_naive_flat_and_bucketed_present_one_interface(pool):
    """NaiveDDP, FlatDDP and DDP behind no_sync / finish_gradient_synchronization /
    clip_grad_norm_, driven by one loop, equal one process (clipping included, and active)."""
    ref_state, ref_norms, _ = _train_through_the_interface([None])[None]
    assert all(nrm > 0.05 for nrm in ref_norms)  # the clip is active at every step
    for out in pool(2).run(_train_through_the_interface, ["naive", "flat", "bucketed"]):
        for kind, (state, norms, quiet) in out.items():
            assert quiet == [0, 0, 0], f"{kind} communicated inside no_sync()"
            assert norms == pytest.approx(ref_norms, rel=1e-5), kind
            for k in ref_state:
                torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{kind} {k}: {m}")


def test_every_gradient_sync_is_one_interface():
    """Every object that averages gradients implements minidist.sync.GradientSync, and the
    clip is the base's, written once (no class writes its own)."""
    from minidist.compose.mesh import MeshSync
    from minidist.compose.pipeline_sync import PipelineSync
    from minidist.compose.zero_muon import MuonUnderZero, MuonUnderZero3
    from minidist.ddp import FlatDDP, NaiveDDP
    from minidist.sync import GradientSync
    from minidist.zero import FSDP, FullyShardedOptimizer, ShardedOptimizer
    syncs = [NaiveDDP, FlatDDP, DDP, ShardedOptimizer, FullyShardedOptimizer, FSDP, MeshSync,
             MuonUnderZero, MuonUnderZero3, PipelineSync]
    for cls in syncs:
        assert issubclass(cls, GradientSync), cls.__name__
        assert cls.clip_grad_norm_ is GradientSync.clip_grad_norm_, f"{cls.__name__} writes its own clip"
    assert issubclass(DDP, nn.Module)
