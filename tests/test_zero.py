"""ZeRO stages 1 and 2 (minidist.zero.ShardedOptimizer): equal to a plain single-process
optimizer on the whole batch (AdamW with two param groups, SGD with momentum; gradient
accumulation; a frozen parameter; tied weights) at 2, 3 and 4 ranks; equal to torch's
ZeroRedundancyOptimizer; and the memory and bytes sent equal the ZeRO paper's formulas."""

import pytest
import torch

from minidist.dist import launch

CFG = dict(n_layer=2, n_head=2, n_embd=24, block_size=8, vocab_size=61)  # 61, 24: nothing divides
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


def _sharded(opt_name, stage, reduce_gradients, accum, collectives="torch"):
    """Each rank: its slice of every batch, in `accum` micro-steps; ZeRO does the rest."""
    import torch.distributed as dist

    from minidist.ddp import allreduce_gradients_flat
    from minidist.train_gpt import forward_backward
    from minidist.zero import ShardedOptimizer
    r, n = dist.get_rank(), dist.get_world_size()
    model = _model()
    cls, kw = OPTIMIZERS[opt_name]
    opt = ShardedOptimizer(_groups(model), cls, stage=stage, reduce_gradients=reduce_gradients,
                           bucket_cap_mb=0.004, collectives=collectives, **kw)  # several buckets
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
    return [p.detach().clone() for p in model.parameters()], {**opt.memory_bytes(), "pieces": pieces,
                                                              "buckets": len(opt.units)}


CASES = [("adamw", 1, False, 1), ("adamw", 1, True, 2), ("adamw", 2, True, 1),
         ("sgd", 2, True, 2), ("sgd", 1, True, 1)]


def _all_cases():
    return {c: _sharded(*c) for c in CASES}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stages_1_and_2_equal_the_plain_optimizer(world):
    results = launch(_all_cases, world)  # one launch for every case at this world size
    oracle = {name: _plain(name) for name in OPTIMIZERS}
    for case in CASES:
        for rank_result in results:
            params, mem = rank_result[case]
            for a, b in zip(params, oracle[case[0]]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")
            assert mem["params"] > 0


def _zero_redundancy_parity():
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from minidist.zero import ShardedOptimizer
    out = {}
    for name, make in (("ours", lambda ps: ShardedOptimizer(ps, torch.optim.AdamW, lr=1e-2)),
                       ("torch", lambda ps: ZeroRedundancyOptimizer(ps, torch.optim.AdamW, lr=1e-2))):
        model = _model()
        opt = make([p for p in model.parameters() if p.requires_grad])
        for step in range(STEPS):
            x, y = _batch(step)
            model(x, y)[1].backward()  # same batch on every rank: gradients already "averaged"
            opt.step()
            opt.zero_grad()
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out, dist.get_rank()


def test_sharded_optimizer_equals_zero_redundancy_optimizer():
    for out, _ in launch(_zero_redundancy_parity, 2):
        for a, b in zip(out["ours"], out["torch"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _accounting():
    import torch.distributed as dist

    from minidist.comm import count_bytes
    out = {}
    for stage in (1, 2):
        with count_bytes() as sent:
            params, mem = _sharded("adamw", stage, True, 1, collectives="minidist")
        out[stage] = (dist.get_world_size(), mem, dict(sent))
    return out


def test_memory_and_bytes_sent_match_the_formulas():
    model = _model()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for n, mem, sent in (r[stage] for r in launch(_accounting, 3) for stage in (1, 2)):
        padded = psi + mem["padding_elements"]
        assert padded % n == 0 and mem["padding_elements"] < n * mem["buckets"]  # < N per bucket
        assert mem["buckets"] > 3
        assert mem["params"] == 4 * padded  # stages 1 and 2 keep full parameters
        # AdamW: exp_avg and exp_avg_sq of the shard (8 bytes/element), + a step counter
        # per tensor (a 4-byte scalar each); K * Psi / N with K = 8, padding included
        assert mem["optimizer_state"] == 8 * padded // n + 4 * mem["pieces"]
        assert mem["grads"] == 4 * padded // n  # at rest after the step: the shard only
        # the paper's volume: 2 * Psi * (N - 1) / N elements per step, counted on the wire
        per_step = 4 * padded * (n - 1) // n
        assert sent["reduce_scatter"] == STEPS * per_step
        assert sent["all_gather"] == STEPS * per_step
