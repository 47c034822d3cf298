"""Chapter 13, experts (minidist/experts/, minidist/compose/expert_sync.py) against oracles:
the MoE layer equal to a loop over tokens (outputs and gradients, dropless and with a
capacity), the balance loss at its two ends, the parameter and FLOP formulas against the
built model; then expert parallelism at ep 2 and 4, and ep 2 x 2 replicas, against one
process's MoE GPT on the whole batch: the loss, every gradient, the tokens each expert got
and those dropped; the all-to-all's autograd against torch's all_to_all_single; and the
gradient rule: averaging an expert over its replicas, the planted mistake, is caught.
One pool call per world size does every distributed case.

Tolerance, fp32: rtol 1e-5, atol 1e-6 (the same sums in another order: the whole batch in
one matmul against each rank's rows, tokens regrouped by the all-to-all).
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.compose.expert_sync import ExpertSync, expert_groups
from minidist.ddp import allreduce_gradients_flat
from minidist.experts import (MoE, MoEConfig, MoEGPT, balance_sum, expert_parallel, moe_flops_per_token,
                              moe_num_params)
from minidist.experts.parallel import _AllToAll, local_experts
from minidist.model import GPT, GPTConfig, flops_per_token, num_params
from minidist.train import forward_backward

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
B, T = 2, 8  # each rank's rows


# ------------------------------------------------------------------ one process

def _loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE written token by token: softmax, top-k, renormalised (at k > 1), each expert taking the
    first `cap` choices of it in token order, the gate-weighted sum of what was kept."""
    h = x.reshape(-1, x.shape[-1])
    E, k, n = moe.n_experts, moe.top_k, h.shape[0]
    cap = float("inf") if not moe.capacity_factor else -(-moe.capacity_factor * n * k // E)
    taken, rows = [0] * E, []
    for t in range(n):
        p = F.softmax(moe.router(h[t]).float(), dim=-1)
        top = p.topk(k)
        out = torch.zeros_like(h[t])
        for g, e in zip(top.values / top.values.sum() if k > 1 else top.values, top.indices.tolist()):
            if taken[e] < cap:
                out = out + g * moe.experts[str(e)](h[t])
            taken[e] += 1
        rows.append(out)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("top_k,factor", [(2, 0.0), (2, 1.0), (1, 0.5)])
def test_the_moe_equals_a_loop_over_tokens(top_k, factor):
    torch.manual_seed(0)
    moe = MoE(16, 4, top_k, hidden=24, capacity_factor=factor)
    x = torch.randn(2, 6, 16, requires_grad=True)
    w = torch.randn(2, 6, 16)
    got = moe(x)
    grads = torch.autograd.grad((got * w).sum(), [x, *moe.parameters()], allow_unused=True)
    want = _loop(moe, x)
    oracle = torch.autograd.grad((want * w).sum(), [x, *moe.parameters()], allow_unused=True)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(grads, oracle):
        torch.testing.assert_close(a if a is not None else torch.zeros(()), b if b is not None else
                                   torch.zeros(()), **TOL)
    assert sum(moe.stats["tokens"]) == 12 * top_k  # every choice counted, kept or not
    if factor == 0.0:
        assert moe.stats["dropped"] == 0
    if factor == 0.5:  # 2 slots x 4 experts for 12 choices
        assert moe.stats["dropped"] >= 4


def test_the_router_learns_from_the_loss_at_top_1_and_top_2():
    """At top-1 the gate is the router's probability (a renormalised one would be 1 and the
    router would get no gradient from anything but the balance loss)."""
    for k in (1, 2):
        torch.manual_seed(0)
        moe = MoE(16, 4, k, hidden=24)
        moe(torch.randn(2, 6, 16)).square().sum().backward()
        assert moe.router.weight.grad.norm() > 1e-2


def test_the_moe_under_bf16_autocast_stays_near_fp32():
    """The experts' matmuls in bf16, the router's softmax and the combine in fp32: the output
    within bf16's rounding of the fp32 one (8 bits of mantissa through two matmuls: 2%)."""
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, hidden=24)
    x = torch.randn(2, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = moe(x)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, moe(x), rtol=0.02, atol=0.02 * moe(x).abs().max().item())


def test_the_balance_loss_is_one_when_uniform_and_e_when_collapsed():
    E, N = 4, 12
    uniform = torch.full((N, E), 1 / E)
    assert balance_sum(uniform, torch.full((E,), 1 / E)).item() == pytest.approx(N)
    collapsed = F.one_hot(torch.zeros(N, dtype=torch.long), E).float()
    assert balance_sum(collapsed, torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(E * N)


def test_parameters_and_flops_follow_the_formulas():
    cfg = GPTConfig(**CFG)
    for moe in (MoEConfig(4, 2), MoEConfig(4, 1, every=2, hidden=8), MoEConfig(1, 1)):
        model = MoEGPT(cfg, moe)
        assert num_params(model) == moe_num_params(cfg, moe)
        layer = model.moe_layers()[0]
        per_expert = sum(p.numel() for p in layer.experts["0"].parameters())
        spare = (moe.n_experts - moe.top_k) * per_expert * len(model.moe_layers())
        assert moe_num_params(cfg, moe, active=True) == num_params(model) - spare
        # a token's extra FLOPs over the dense GPT's: 6 per extra active parameter
        extra = moe_num_params(cfg, moe, active=True) - num_params(GPT(cfg))
        assert moe_flops_per_token(cfg, moe) - flops_per_token(cfg) == 6 * extra


@pytest.mark.parametrize("bad", [dict(n_experts=0), dict(n_experts=4, top_k=5), dict(capacity_factor=-1),
                                 dict(every=0), dict(aux_loss_weight=-0.1), dict(capacity_factor=float("nan")),
                                 dict(aux_loss_weight=float("inf"))])
def test_bad_moe_configs_are_refused(bad):
    with pytest.raises(ValueError, match="must|need"):
        MoEConfig(**bad)


def test_the_moe_layer_refuses_what_it_cannot_route():
    with pytest.raises(ValueError, match="capacity_factor=nan must be finite and >= 0"):
        MoE(16, 4, 2, capacity_factor=float("nan"))
    for x in (torch.zeros(6, 16), torch.zeros(2, 3, 8)):  # tokens without a batch axis; the wrong width
        with pytest.raises(ValueError, match=r"MoE takes \(B, T, 16\) activations, got"):
            MoE(16, 4, 2)(x)


# ------------------------------------------------------------------ expert parallelism

SETUPS = {2: [2], 4: [4, 2]}  # world: the ep sizes (ep 2 on 4 ranks: two replicas per expert)
MOES = {"dropless": MoEConfig(4, 2), "capacity": MoEConfig(4, 2, capacity_factor=1.0)}


def _batch(world):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG["vocab_size"], (world * B, T), generator=g)
    y = torch.randint(0, CFG["vocab_size"], (world * B, T), generator=g)
    y[0, :3] = -1  # masked targets count nowhere
    return x, y


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _alltoall_vs_torch(r, n):
    """_AllToAll forward and backward against torch.distributed.nn's all_to_all_single on
    uneven splits (rank r sends r + j + 1 rows to rank j)."""
    from torch.distributed.nn.functional import all_to_all_single
    send = [r + j + 1 for j in range(n)]
    recv = [j + r + 1 for j in range(n)]
    x = torch.randn(sum(send), 3, generator=torch.Generator().manual_seed(r))
    w = torch.randn(sum(recv), 3)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    a = _AllToAll.apply(ours, send, recv, None)
    b = all_to_all_single(torch.empty(sum(recv), 3), theirs, recv, send)
    (a * w).sum().backward()
    (b * w).sum().backward()
    return torch.equal(a, b) and torch.equal(ours.grad, theirs.grad)


def _on_ranks(world):
    r = dist.get_rank()
    x, y = _batch(world)
    out = {"a2a": _alltoall_vs_torch(r, world)}
    groups = {ep: expert_groups(ep) for ep in SETUPS[world]}
    for name, mc in MOES.items():
        torch.manual_seed(0)
        full = MoEGPT(GPTConfig(**CFG), mc)
        for layer in full.moe_layers():  # clear choices: no k-th expert within rounding of the next
            layer.router.weight.data.mul_(20)
        oracle = copy.deepcopy(full)  # one process, the whole batch, chapter 04's normalisation
        loss_sum = oracle(x, y, reduction="sum")[1]
        (loss_sum / (y != -1).sum()).backward()
        want_loss, want = (loss_sum / (y != -1).sum()).item(), _grads(oracle)
        want_stats = [m.stats for m in oracle.moe_layers()]
        for ep, (ep_group, replicas) in groups.items():
            for rule, scale in (("right", None), ("replica average", world // ep), ("world average", None)):
                model = expert_parallel(copy.deepcopy(full), ep_group, dist.group.WORLD)
                sync = ExpertSync(model, ep_group, replicas, replica_scale=scale)
                mine = slice(r * B, (r + 1) * B)
                if rule == "world average":  # plain data parallelism over everything: other experts mixed in
                    loss = forward_backward(model, [(x[mine], y[mine])], world)
                    allreduce_gradients_flat(model)
                else:
                    loss = forward_backward(model, [(x[mine], y[mine])], world, sync)
                got = _grads(model)
                errs = {n: ((got[n] - want[n]).abs() - TOL["rtol"] * want[n].abs()).max().item()
                        for n in got}
                out[name, ep, rule] = {
                    "loss": (loss, want_loss), "errs": errs, "names": sorted(got),
                    "stats": [m.stats for m in model.moe_layers()], "want_stats": want_stats,
                    "norm": (sync.grad_square_sum().item(), sum(g.double().square().sum().item()
                                                              for g in want.values())),
                    "local": list(local_experts(4, ep_group))}
    return out


@functools.lru_cache(maxsize=None)
def _results(pool, world):
    return pool(world).run(_on_ranks, world)


CASES = [(w, ep, name) for w, eps in SETUPS.items() for ep in eps for name in MOES]


@pytest.mark.parametrize("world,ep,name", CASES)
def test_expert_parallel_equals_one_process(pool, world, ep, name):
    for rank, res in enumerate(_results(pool, world)):
        case = res[name, ep, "right"]
        loss, want = case["loss"]
        assert loss == pytest.approx(want, rel=1e-6), f"rank {rank}: loss {loss} vs one process {want}"
        bad = {n: e for n, e in case["errs"].items() if e > TOL["atol"]}
        assert not bad, f"rank {rank}, ep {ep}: gradients differ from one process: {bad}"
        experts = {n.split(".experts.")[1].split(".")[0] for n in case["names"] if ".experts." in n}
        assert experts == {str(e) for e in case["local"]}, "a rank holds other experts than its own"
        assert case["stats"] == case["want_stats"], "tokens per expert or drops differ from one process"
        norm, want_norm = case["norm"]
        assert norm == pytest.approx(want_norm, rel=1e-5)
    if name == "capacity":
        assert sum(s["dropped"] for s in case["want_stats"]) > 0, "the capacity case drops nothing"


@pytest.mark.parametrize("world,ep", [(w, ep) for w, eps in SETUPS.items() for ep in eps])
@pytest.mark.parametrize("rule", ["replica average", "world average"])
def test_the_wrong_gradient_rules_are_caught(pool, world, ep, rule):
    """An expert averaged over its replicas (ep times too large), or every parameter
    averaged over the world as plain data parallelism does (other ranks' experts mixed in):
    the experts' gradients differ from one process's, the shared ones do not."""
    for res in _results(pool, world):
        errs = res["dropless", ep, rule]["errs"]
        assert max(e for n, e in errs.items() if ".experts." in n) > 1e-3
        assert max(e for n, e in errs.items() if ".experts." not in n) <= TOL["atol"]


@pytest.mark.parametrize("world", sorted(SETUPS))
def test_our_all_to_all_autograd_equals_torchs(pool, world):
    assert all(res["a2a"] for res in _results(pool, world))


def test_experts_that_do_not_split_over_the_ep_group_are_refused(pool):
    def refuse():
        try:
            local_experts(3, None)
        except ValueError as e:
            return str(e)
    assert "divisible by 2" in pool(2).run(refuse)[0]
