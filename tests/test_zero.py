"""ZeRO stages 1, 2 (minidist.zero.ShardedOptimizer) and 3 (minidist.zero.FullyShardedOptimizer): equal to a
plain single-process optimizer on the whole batch (AdamW with two param groups, SGD with
momentum; gradient accumulation; a frozen parameter; tied weights) at 2, 3 and 4 ranks;
equal to torch's ZeroRedundancyOptimizer and FSDP2 (fully_shard); and the memory held and
bytes sent equal the ZeRO paper's formulas, counted on the wire."""

import pytest
import torch

from minidist.launch import launch

CFG = dict(n_layer=2, n_head=2, n_embd=20, block_size=8, vocab_size=61)  # 3 ranks: padding
B, STEPS = 24, 3  # 24: divides by 2, 3, 4 ranks x 2 micro-steps


def _model():
    from minidist.model import GPT, GPTConfig
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG))
    m.wpe.weight.requires_grad_(False)  # a frozen parameter
    return m


def _groups(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# eps 1e-4, not 1e-8: the key projection's bias has an exactly zero gradient (softmax ignores
# a shift shared by all keys), so what arrives is rounding noise, which Adam with a tiny eps
# would blow up to +-lr differently for every summation order
OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4)),
              "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG["vocab_size"], (B, CFG["block_size"]), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _plain(opt_name):
    """The oracle: one process, the whole batch, the plain optimizer."""
    model = _model()
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(_groups(model), **kw)
    for step in range(STEPS):
        x, y = _batch(step)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _sharded(opt_name, stage, reduce_gradients, accum, collectives="torch", prefetch=True, cap=0.004):
    """Each rank: its slice of every batch, in `accum` micro-steps; ZeRO does the rest."""
    import contextlib

    import torch.distributed as dist

    from minidist.ddp import allreduce_gradients_flat
    from minidist.train import forward_backward
    from minidist.zero import ShardedOptimizer
    from minidist.zero import FullyShardedOptimizer
    r, n = dist.get_rank(), dist.get_world_size()
    model = _model()
    cls, kw = OPTIMIZERS[opt_name]
    if stage == 3:  # cap 0.004 MiB (1048 floats) cuts each block into several units
        opt = FullyShardedOptimizer(model, _groups(model), cls, prefetch=prefetch,
                                    bucket_cap_mb=cap, collectives=collectives, **kw)
    else:
        opt = ShardedOptimizer(_groups(model), cls, stage=stage, reduce_gradients=reduce_gradients,
                               bucket_cap_mb=cap, collectives=collectives, module=model, **kw)
    per = B // n
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        m = per // accum
        micro = [(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) for i in range(accum)]
        forward_backward(model, micro, n, opt if opt.reduce_gradients else None)
        if not opt.reduce_gradients:  # ZeroRedundancyOptimizer's contract: DDP averaged them
            allreduce_gradients_flat(model)
        opt.step()
        opt.zero_grad()
    pieces = sum(len(g["params"]) for g in opt.param_groups)  # shard tensors the optimizer sees
    mem = {**opt.memory_bytes(), "pieces": pieces, "buckets": len(opt.units),
           "unit_elements": [u.flat.numel() for u in opt.units]}
    if stage == 3:
        mem["root_elements"] = sum(u.flat.numel() for u in opt.root)
        mem["block_elements"] = [sum(u.flat.numel() for u in block) for block in opt.blocks]
    with opt.gathered() if stage == 3 else contextlib.nullcontext():  # stage 3: read, then free
        return [p.detach().clone() for p in model.parameters()], mem


CASES = [("adamw", 1, False, 1), ("adamw", 1, True, 2), ("adamw", 2, True, 1),
         ("sgd", 2, True, 2), ("sgd", 1, True, 1), ("adamw", 3, True, 1), ("sgd", 3, True, 2),
         ("adamw", 3, True, 2, "torch", False),  # stage 3 without prefetch
         ("adamw", 3, True, 1, "torch", True, None)]  # stage 3, one unit per block


def _layouts():
    """Which parameters share a unit, for each meaning of bucket_cap_mb, in DDP and at every
    ZeRO stage (fresh models: each wrapper hooks its own)."""
    from minidist.ddp import DDP
    from minidist.zero import zero_optimizer
    out = {}
    for cap in (0, 0.004, None):
        index = lambda m: {id(p): i for i, p in enumerate(m.parameters())}
        m = _model()
        out[cap, 0] = [[index(m)[id(p)] for p in b.params] for b in DDP(m, bucket_cap_mb=cap).buckets]
        for stage in (1, 2, 3):
            m = _model()
            opt = zero_optimizer(m, _groups(m), torch.optim.SGD, stage, bucket_cap_mb=cap, lr=0.1)
            units = [opt.root, *opt.blocks] if stage == 3 else [opt.units]
            out[cap, stage] = [[sorted(index(m)[id(p)] for p in u.params) for u in us] for us in units]
    return out


def _all_cases():
    return {"layouts": _layouts(), **{c: _sharded(*c) for c in CASES}}


def _check_bucket_cap_means_the_same_in_ddp_and_every_zero_stage(out):
    model = _model()
    trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
    for cap in (0, 0.004, None):
        ddp = [sorted(b) for b in out[cap, 0]]
        assert out[cap, 1] == out[cap, 2] == [ddp]  # stages 1 and 2: DDP's buckets
        assert sorted(i for b in ddp for i in b) == trainable
    assert all(len(b) == 1 for b in out[0, 0]) and len(out[None, 0]) == 1
    assert 1 < len(out[0.004, 0]) < len(trainable)
    blocks = [sorted(i for u in units for i in u) for units in out[None, 3][1:]]
    for cap in (0, 0.004):  # stage 3: the cap cuts a block (or the root) into units
        assert [sorted(i for u in units for i in u) for units in out[cap, 3][1:]] == blocks
    assert all(len(u) == 1 for units in out[0, 3] for u in units)
    assert all(len(units) == 1 for units in out[None, 3])  # None: one unit per block, one root
    assert any(len(units) > 1 for units in out[0.004, 3][1:])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_stage_equals_the_plain_optimizer(world, pool):
    results = pool(world).run(_all_cases)  # one call for every case at this world size (tests/conftest.py)
    oracle = {name: _plain(name) for name in OPTIMIZERS}
    _check_bucket_cap_means_the_same_in_ddp_and_every_zero_stage(results[0]["layouts"])
    for case in CASES:
        for rank_result in results:
            assert rank_result["layouts"] == results[0]["layouts"]  # every rank cuts alike
            params, mem = rank_result[case]
            for a, b in zip(params, oracle[case[0]]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")
            assert mem["params"] > 0


def _torch_parity():
    """Ours and torch's on the same model and data: ShardedOptimizer against
    ZeroRedundancyOptimizer (whole batch on every rank: gradients already "averaged"), and
    ZeRO-3 against FSDP2's fully_shard (each rank its slice of the batch)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from minidist.zero import ShardedOptimizer
    from minidist.zero import FullyShardedOptimizer
    r, n = dist.get_rank(), dist.get_world_size()
    cls, kw = OPTIMIZERS["adamw"]
    out = {}
    from minidist.scaler import LossScaler
    for name in ("ours_1", "ours_1_scaled", "zero_redundancy", "ours_3", "fully_shard"):
        model = _model()
        trainable = [p for p in model.parameters() if p.requires_grad]
        scaler = LossScaler(init_scale=1024.0, enabled=name == "ours_1_scaled")
        if name.startswith("ours_1"):
            opt = ShardedOptimizer(trainable, cls, **kw)
        elif name == "zero_redundancy":
            opt = ZeroRedundancyOptimizer(trainable, cls, **kw)
        elif name == "ours_3":
            opt = FullyShardedOptimizer(model, trainable, cls, **kw)
        else:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            opt = cls([p for p in model.parameters() if p.requires_grad], **kw)
        for step in range(STEPS):
            x, y = _batch(step)
            if name in ("ours_3", "fully_shard"):
                per = B // n
                x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
            scaler.scale(model(x, y)[1]).backward()
            if name.startswith("ours"):  # the gradients the step will use, before the scaler
                opt.finish_gradient_synchronization()  # looks (ZeroRedundancyOptimizer's contract)
            scaler.step(opt)  # (a plain opt.step() when disabled)
            scaler.update()
            opt.zero_grad()
        if name == "ours_3":
            with opt.gathered():
                out[name] = [p.detach().clone() for p in model.parameters()]
        else:
            out[name] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                         for p in model.parameters()]
    return out


def test_ours_equal_zero_redundancy_optimizer_and_fully_shard():
    for out in launch(_torch_parity, 2):
        for a, b, c in zip(out["ours_1"], out["zero_redundancy"], out["ours_1_scaled"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(c, b, rtol=1e-6, atol=1e-7)  # the scaler unscales the shard
        for a, b in zip(out["ours_3"], out["fully_shard"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32: summation order


def _accounting():
    import torch.distributed as dist

    from minidist.comm import count_bytes
    out = {}
    for stage in (1, 2, 3):
        with count_bytes() as sent:
            params, mem = _sharded("adamw", stage, True, 1, collectives="minidist")
        out[stage] = (dist.get_world_size(), mem, dict(sent))
    return out


def test_memory_and_bytes_sent_match_the_formulas(pool):
    model = _model()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    results = pool(3).run(_accounting)
    for stage, (n, mem, sent) in ((s, r[s]) for r in results for s in (1, 2)):
        padded = psi + mem["padding_elements"]
        assert padded % n == 0 and mem["padding_elements"] < n * mem["buckets"]  # < N per bucket
        assert mem["buckets"] > 3
        assert mem["params"] == 4 * padded  # stages 1 and 2 keep full parameters
        # AdamW: exp_avg and exp_avg_sq (8 bytes per element of a real parameter: padding
        # gets no state) and a 4-byte step counter per shard piece. K Psi / N, up to padding
        assert 8 * (padded // n - mem["padding_elements"]) <= mem["optimizer_state"] - 4 * mem["pieces"]
        assert mem["optimizer_state"] - 4 * mem["pieces"] <= 8 * padded // n
        # stage 1 keeps full gradients (one flat buffer, reduce-scattered in place);
        # stage 2 only its shard of them once backward is over
        assert mem["grads"] == (4 * padded if stage == 1 else 4 * padded // n)
        # the paper's volume: 2 * Psi * (N - 1) / N elements per step, counted on the wire
        per_step = 4 * padded * (n - 1) // n
        assert sent["reduce_scatter"] == STEPS * per_step
        assert sent["all_gather"] == STEPS * per_step
    for n, mem, sent in (r[3] for r in results):
        padded = sum(mem["unit_elements"])
        assert padded == mem["root_elements"] + sum(mem["block_elements"])
        assert mem["params"] == 4 * padded // n  # at rest: this rank's shard, nothing gathered
        assert mem["grads"] == 4 * padded // n
        assert mem["optimizer_state"] - 4 * mem["pieces"] <= 8 * padded // n
        # at peak: the root (kept from forward to backward), a block, the next block prefetched
        biggest_block = max(mem["block_elements"])
        assert mem["peak_gathered"] <= 4 * (mem["root_elements"] + 2 * biggest_block)
        assert mem["peak_gathered"] >= 4 * (mem["root_elements"] + biggest_block)
        # every unit gathered in forward, every block again in backward, gradients
        # reduce-scattered: 3 Psi (N-1)/N less the root's second gather; then one more
        # gather of everything, to read the parameters at the end
        ring = lambda elements: 4 * elements * (n - 1) // n
        assert sent["all_gather"] == STEPS * ring(2 * padded - mem["root_elements"]) + ring(padded)
        assert sent["reduce_scatter"] == STEPS * ring(padded)
    # summed over the ranks, the state is exactly K Psi (+ the step counters): no element
    # is held twice, and padding holds none
    for stage in (1, 2, 3):
        mems = [r[stage][1] for r in results]
        assert sum(m["optimizer_state"] - 4 * m["pieces"] for m in mems) == 8 * psi
    assert any(r[1][1]["padding_elements"] for r in results)  # the case above was exercised
