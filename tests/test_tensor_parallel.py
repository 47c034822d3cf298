"""Chapter 10: minidist.tensor_parallel against its oracles. At tp 2, 3 and 4, with and
without sequence parallelism: the loss equals one process's (and is the same number on
every rank) and every shard's gradient equals the matching slice of the full model's;
torch's own tensor parallelism (DTensor, Colwise/Rowwise plans) gives our MLP's and our
attention's outputs and gradients; the bytes handed to collectives, the parameter bytes
per rank and the activation bytes saved for backward equal the module's closed forms;
dropout draws per-rank masks where it must and shared ones where it must.

One pool call per world size runs every case (the ranks return what the tests check);
the one-process oracle runs here, once per configuration.

Tolerance, fp32: rtol 1e-5, atol 1e-6. The arithmetic is the full model's, grouped
differently (matmuls over slices summed by all-reduces, the softmax's sum over vocabulary
shards), so results differ by summation order only: a few ulps (fp32 eps 1.2e-7) on
values of order 1e-3..10, far inside the tolerance and far below any real error (a
missing or doubled all-reduce is off by a factor, a wrong slice by O(1)). Gradients of a
summed loss are n (the target count) times the mean's, and so is their rounding: their
atol is n x 1e-6.
"""

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minidist import memory
from minidist import tensor_parallel as tp
from minidist.tensor_parallel import cost as tpc
from minidist.tensor_parallel import gpt as tpg
from minidist.cost_model import SENT_FRACTION
from minidist.model import GPT, GPTConfig
from minidist.memory.recompute import set_activation_checkpointing

TOL = dict(rtol=1e-5, atol=1e-6)
B, T = 2, 12  # T divides by 2, 3 and 4: sequence parallelism at every tp tested
EVEN = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
UNEVEN = {**EVEN, "vocab_size": 61}   # 61 rows: 31/30 at tp 2, 16/15/15/15 at tp 4
SIX = dict(n_layer=2, n_head=6, n_embd=48, block_size=16, vocab_size=61)  # heads for tp 3


def _full(cfg: dict, dropout=0.0) -> GPT:
    torch.manual_seed(0)  # the same weights in every process
    model = GPT(GPTConfig(**cfg, dropout=dropout))
    with torch.no_grad():  # GPT starts biases at 0 and gains at 1: a bias added twice, or
        for p in model.parameters():  # a gain on the wrong positions, would not show
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(V: int):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    y[0, 7:] = -1  # ignored targets, as model.GPT.forward's ignore_index
    y[1, :3] = -1
    return x, y


# (config, sequence_parallel, reduction, activation checkpointing)
# every layout with the mean over an even vocabulary and the sum over an uneven one
CASES = [(cfg, sp, red, False) for cfg, red in (("EVEN", "mean"), ("UNEVEN", "sum")) for sp in (False, True)]
CASES += [("EVEN", True, "mean", True), ("UNEVEN", False, "sum", True)]
CASES_3 = [("SIX", sp, red, False) for sp in (False, True) for red in ("mean", "sum")]
CONFIGS = {"EVEN": EVEN, "UNEVEN": UNEVEN, "SIX": SIX}


def _shard_step(cfg, sp, reduction, recompute):
    """This rank's loss and {name: (spec, gradient)} after one forward and backward."""
    m = tpg.parallelize(_full(CONFIGS[cfg]), dist.group.WORLD, sp)
    set_activation_checkpointing(m, recompute)
    x, y = _batch(m.config.vocab_size)
    _, loss = m(x, y, reduction=reduction)
    loss.backward()
    spec = tpg.shard_spec(m)
    return loss.detach(), {n: (spec[n], p.grad.clone()) for n, p in m.named_parameters()}


# ---------------------------------------------------------------- counting what the ranks do

@contextlib.contextmanager
def _counting_collectives():
    """Bytes handed to each collective (all-reduce: the tensor, all-gather: its output,
    reduce-scatter: its input), counted by wrapping torch.distributed's functions."""
    counts = Counter()
    which = {"all_reduce": ("all_reduce", 0), "all_gather_single": ("all_gather", 0),
             "reduce_scatter_single": ("reduce_scatter", 1)}
    real = {name: getattr(dist, name) for name in which}

    def wrap(name):
        kind, arg = which[name]

        def counted(*args, **kwargs):
            counts[kind] += args[arg].numel() * args[arg].element_size()
            return real[name](*args, **kwargs)
        return counted

    for name in which:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:  # the pool's processes live on: leave torch.distributed as it was
        for name, fn in real.items():
            setattr(dist, name, fn)


def _sent(counts) -> float:
    t = dist.get_world_size()
    return sum(SENT_FRACTION[k](t) * v for k, v in counts.items())


def _bytes_and_memory():
    """Counted bytes (a forward alone, and a whole step) and saved activation bytes."""
    out = {}
    for sp in (False, True):
        m = tpg.parallelize(_full(UNEVEN), dist.group.WORLD, sp)
        x, y = _batch(61)
        with _counting_collectives() as fwd:
            m(x, y)
        with _counting_collectives() as step:
            m(x, y)[1].backward()
        saved = memory.count_saved_bytes(m, x, y)["blocks"]
        params = sum(p.numel() * p.element_size() for p in m.parameters())
        out[sp] = dict(forward_sent=_sent(fwd), step=dict(step), step_sent=_sent(step),
                           saved=saved, params=params)
    return out


# ---------------------------------------------------------------- torch's tensor parallelism

class _SplitQKV(nn.Module):
    """model.CausalSelfAttention with q, k and v as three Linears (the same weights), the
    shape torch's plans split by heads: Colwise on each cuts whole heads."""

    def __init__(self, full):
        super().__init__()
        C = full.c_attn.in_features
        self.n_head = full.n_head
        self.q, self.k, self.v = (nn.Linear(C, C) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(full.c_attn.weight[i * C:(i + 1) * C])
                lin.bias.copy_(full.c_attn.bias[i * C:(i + 1) * C])
        self.o = nn.Linear(C, C)
        self.o.load_state_dict(full.c_proj.state_dict())

    def forward(self, x):
        Bx, Tx, _ = x.shape
        q, k, v = (f(x).view(Bx, Tx, self.n_head, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(Bx, Tx, -1))


def _against_torch_tp():
    """Our ParallelMLP and ParallelAttention against torch's parallelize_module on the same
    weights and input: outputs, input gradients, and each weight's local gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t, group = dist.get_world_size(), dist.group.WORLD
    mesh = init_device_mesh("cpu", (t,))
    full = _full(EVEN).blocks[0]
    torch.manual_seed(3)
    x, w = torch.randn(B, T, 32), torch.randn(B, T, 32)  # w: a loss that weighs every output
    results = {}

    def run(module):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        (y * w).sum().backward()
        return y.detach(), xi.grad

    theirs_mlp = parallelize_module(_copy(full.mlp), mesh, {"c_fc": ColwiseParallel(),
                                                           "c_proj": RowwiseParallel()})
    ours_mlp = tpg.ParallelMLP(full.mlp, group)
    results["mlp"] = (run(ours_mlp), run(theirs_mlp),
                      [(ours_mlp.c_fc.weight.grad, theirs_mlp.c_fc.weight.grad.to_local()),
                       (ours_mlp.c_fc.bias.grad, theirs_mlp.c_fc.bias.grad.to_local()),
                       (ours_mlp.c_proj.weight.grad, theirs_mlp.c_proj.weight.grad.to_local()),
                       (ours_mlp.c_proj.bias.grad, theirs_mlp.c_proj.bias.grad.to_local())])

    theirs_attn = parallelize_module(_SplitQKV(full.attn), mesh, {
        "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()})
    theirs_attn.n_head //= t  # each rank now holds n_head / t whole heads
    ours_attn = tpg.ParallelAttention(full.attn, group)
    ours, theirs = run(ours_attn), run(theirs_attn)
    qkv = [theirs_attn.q, theirs_attn.k, theirs_attn.v]
    results["attention"] = (ours, theirs, [
        (ours_attn.c_attn.weight.grad, torch.cat([m.weight.grad.to_local() for m in qkv])),
        (ours_attn.c_attn.bias.grad, torch.cat([m.bias.grad.to_local() for m in qkv])),
        (ours_attn.c_proj.weight.grad, theirs_attn.o.weight.grad.to_local()),
        (ours_attn.c_proj.bias.grad, theirs_attn.o.bias.grad.to_local())])
    return results


def _copy(module):
    import copy
    return copy.deepcopy(module)


# ---------------------------------------------------------------- random numbers

def _dropout_masks():
    """The residual dropout's mask in block 0 and the embedding dropout's, with and without
    sequence parallelism, and a draw inside and after tp_rng; plus, under sequence
    parallelism with dropout on, whether recomputation replays the same masks."""
    out = {}
    x, y = _batch(64)
    for sp in (False, True):
        m = tpg.parallelize(_full(EVEN, dropout=0.5), dist.group.WORLD, sp)
        masks = {}
        def keep(name):
            def hook(module, inp, o):  # returns None: the output stays
                masks.setdefault(name, (o == 0) & (inp[0] != 0))
            return hook
        for name in ("drop", "blocks.0.drop"):
            m.get_submodule(name).register_forward_hook(keep(name))
        torch.manual_seed(11)  # the default stream, alike on every rank
        m(x, y)
        out[sp] = masks
    torch.manual_seed(12)
    with tp.tp_rng(dist.group.WORLD):
        inside = torch.rand(16)
    after = torch.rand(16)
    grads = []
    for recompute in (False, True):
        m = tpg.parallelize(_full(EVEN, dropout=0.3), dist.group.WORLD, True)
        set_activation_checkpointing(m, recompute)
        torch.manual_seed(13)
        m(x, y)[1].backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    return out, inside, after, grads


# ---------------------------------------------------------------- what each rank runs

def _refusals():
    """What parallelize and forward say to shapes they cannot split (every rank raises
    before any collective, so nothing hangs)."""
    msgs = []
    for cfg, sp, seq in ((EVEN, False, T), (SIX, False, T), (SIX, True, T - 1)):
        try:
            m = tpg.parallelize(_full(cfg), dist.group.WORLD, sp)
            z = torch.zeros(B, seq, dtype=torch.long)
            m(z, z)  # training: (sampling, without targets, uses the plain layout)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def _sampled(sp):
    """Tokens the shard samples (the full vocabulary's logits gathered over the group)."""
    m = tpg.parallelize(_full(UNEVEN), dist.group.WORLD, sp).eval()
    g = torch.Generator().manual_seed(5)
    return m.generate(torch.zeros(1, 2, dtype=torch.long), T - 2, temperature=0.8, top_k=7, generator=g)


def _on_ranks(cases, extras: bool):
    out = {"cases": [_shard_step(*c) for c in cases], "refusals": _refusals()}
    if extras:
        out["sampled"] = [_sampled(sp) for sp in (False, True)]
    if extras:
        out.update(bytes=_bytes_and_memory(), torch_tp=_against_torch_tp(), rng=_dropout_masks())
    return out


@pytest.fixture(scope="module")
def ranks(pool):
    """{tp: [what rank r returned]}: one pool call per world size."""
    return {2: pool(2).run(_on_ranks, CASES, True),
            3: pool(3).run(_on_ranks, CASES_3, False),
            4: pool(4).run(_on_ranks, CASES, True)}


@pytest.fixture(scope="module")
def oracle():
    """{(config, reduction): (loss, {name: gradient})} of one process, each computed once."""
    memo = {}
    for cfg, _, red, _ in CASES + CASES_3:
        if (cfg, red) not in memo:
            model = _full(CONFIGS[cfg])
            x, y = _batch(model.config.vocab_size)
            _, loss = model(x, y, reduction=red)
            loss.backward()
            memo[cfg, red] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    return memo


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("t", [2, 3, 4])
def test_loss_and_every_gradient_equal_one_process(ranks, oracle, t):
    cases = CASES_3 if t == 3 else CASES
    for i, case in enumerate(cases):
        ref_loss, ref_grads = oracle[case[0], case[2]]
        losses = [r["cases"][i][0] for r in ranks[t]]
        assert all(torch.equal(lo, losses[0]) for lo in losses), case  # one number everywhere
        torch.testing.assert_close(losses[0], ref_loss, **TOL, msg=str(case))
        # a summed loss is the mean times the target count: so are its gradients and
        # their rounding, so the absolute tolerance scales with it
        n = int((_batch(CONFIGS[case[0]]["vocab_size"])[1] != -1).sum()) if case[2] == "sum" else 1
        for r in ranks[t]:
            grads = r["cases"][i][1]
            assert set(grads) == set(ref_grads)  # the full model's names, each once (tied: wte)
            for name, (spec, grad) in grads.items():
                torch.testing.assert_close(grad, tp.shard_of(ref_grads[name], spec), rtol=TOL["rtol"],
                                           atol=TOL["atol"] * n, msg=lambda m: f"{case} {name}: {m}")


def test_shards_tile_the_full_model(ranks):
    # over the ranks, the ranges of every split parameter cover its dimension once
    i = CASES.index(("UNEVEN", True, "sum", False))
    full = dict(_full(UNEVEN).named_parameters())
    for t in (2, 4):
        specs = [{n: s for n, (s, _) in r["cases"][i][1].items()} for r in ranks[t]]
        for name, p in full.items():
            if specs[0][name] is None:  # replicated: whole on every rank
                assert all(s[name] is None for s in specs), name
                continue
            dim = specs[0][name][0]
            ranges = sorted(rg for s in specs for rg in s[name][1])
            assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]], name
            assert ranges[-1][1] == p.shape[dim], name


@pytest.mark.parametrize("t", [2, 3, 4])
def test_shapes_that_do_not_split_are_refused_by_name(ranks, t):
    even_heads, six_heads, sp_seq = ranks[t][0]["refusals"]
    # 4 heads split 2 and 4 ways, not 3; 6 heads split 2 and 3 ways, not 4
    assert (even_heads is None) == (t != 3)
    assert (six_heads is None) == (t != 4)
    for msg in (even_heads, six_heads):
        assert msg is None or ("n_head" in msg and "divisible by tp" in msg)
    # under sequence parallelism T = 11 does not split over any of 2, 3, 4 ranks
    # (at tp 4 the 6 heads are refused first)
    assert "divisible by tp" in sp_seq and ("T=11" in sp_seq or t == 4)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("part", ["mlp", "attention"])
def test_equals_torch_tensor_parallel(ranks, t, part):
    for r in ranks[t]:
        (y, gx), (y_torch, gx_torch), grads = r["torch_tp"][part]
        torch.testing.assert_close(y, y_torch, **TOL)
        torch.testing.assert_close(gx, gx_torch, **TOL)
        for ours, theirs in grads:
            torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("t", [2, 4])
def test_bytes_per_step_equal_the_closed_form(ranks, t):
    cfg = GPTConfig(**UNEVEN)
    for r in ranks[t]:
        counted = r["bytes"]
        for sp, c in counted.items():
            want = tpc.comm_bytes(cfg, B, T, t, sp)
            assert c["step"] == {k: v for k, v in want.items() if k != "sent" and v}, sp
            assert c["step_sent"] == pytest.approx(want["sent"])
        # the all-gather and reduce-scatter that replace each all-reduce send what it sent
        assert counted[True]["forward_sent"] == pytest.approx(counted[False]["forward_sent"])
        # and the formula's own split: per layer 4 all-reduces of B T C fp32 elements
        no_sp = tpc.comm_bytes(cfg, B, T, t)["all_reduce"]
        assert no_sp == (4 * cfg.n_layer + 2) * B * T * cfg.n_embd * 4 + 3 * B * T * 4


@pytest.mark.parametrize("t", [2, 4])
def test_parameter_bytes_per_rank_equal_the_formula(ranks, t):
    cfg = GPTConfig(**UNEVEN)
    for rank, r in enumerate(ranks[t]):
        for c in r["bytes"].values():
            assert c["params"] == tpc.param_bytes(cfg, t, rank)
    # one rank holding everything is the full model
    assert tpc.param_bytes(cfg, 1) == 4 * sum(p.numel() for p in _full(UNEVEN).parameters())


@pytest.mark.parametrize("t", [2, 4])
def test_activation_bytes_equal_the_formula(ranks, t):
    d, H = EVEN["n_embd"], EVEN["n_head"]
    for r in ranks[t]:
        counted = {k: c["saved"] for k, c in r["bytes"].items()}
        for sp, per_block in counted.items():
            assert per_block == [tpc.tp_block_activation_bytes(B, T, d, H, t, sp)] * 2, sp
        # chapter 09's block, whole on one process, is the tp = 1 case ...
        assert tpc.tp_block_activation_bytes(B, T, d, H) == memory.block_activation_bytes(B, T, d, H)
        # ... and sequence parallelism divides all of it by t, as Korthikanti's formula does
        ratio = counted[True][0] / counted[False][0]
        assert ratio == (tpc.tp_block_activation_bytes(B, T, d, H, t, True)
                         / tpc.tp_block_activation_bytes(B, T, d, H, t, False))
        assert counted[True][0] * t == memory.block_activation_bytes(B, T, d, H)
        k = tpc.korthikanti_activation_bytes
        assert k(T, B, d, H, t, True) * t == pytest.approx(k(T, B, d, H))


def test_dropout_masks_differ_where_each_rank_holds_its_own(ranks):
    for t in (2, 4):
        results = [r["rng"] for r in ranks[t]]
        for name in ("drop", "blocks.0.drop"):
            replicated = [masks[False][name] for masks, *_ in results]
            split = [masks[True][name] for masks, *_ in results]
            # replicated activations: the same mask on every rank (the replicas stay equal)
            assert all(torch.equal(m, replicated[0]) for m in replicated), name
            # this rank's positions under sequence parallelism: its own mask
            assert split[0].shape[1] == T // t
            assert all(not torch.equal(m, split[0]) for m in split[1:]), name
            assert all(0.3 < m.float().mean() < 0.7 for m in split)  # dropout 0.5 did drop
        inside = [r[1] for r in results]
        after = [r[2] for r in results]
        assert all(not torch.equal(a, inside[0]) for a in inside[1:])
        assert all(torch.equal(a, after[0]) for a in after)  # the default stream stays in step


def test_recomputation_replays_the_per_rank_masks(ranks):
    for t in (2, 4):
        for r in ranks[t]:
            plain, recomputed = r["rng"][3]
            assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))


@pytest.mark.parametrize("t", [2, 4])
def test_sampling_draws_the_full_models_tokens(ranks, t):
    # the full model's generate, same seed: the gathered logits are the full model's, so
    # the same tokens (top-k keeps small rounding from changing a draw)
    full = _full(UNEVEN).eval()
    want = full.generate(torch.zeros(1, 2, dtype=torch.long), T - 2, temperature=0.8, top_k=7,
                         generator=torch.Generator().manual_seed(5))
    for r in ranks[t]:
        for got in r["sampled"]:
            assert torch.equal(got, want)
