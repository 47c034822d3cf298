"""Chapter 09: activation checkpointing gives the gradients of the run without it (exactly,
fp32) and torch.utils.checkpoint's, with dropout and autocast; the bytes saved for
backward equal the chapter's formula; the memory model of a step against its measured
peak; recomputation under ZeRO-3."""

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from minidist import memory as M
from minidist.memory import recompute
from minidist.model import GPT, GPTConfig
from minidist.memory.recompute import set_activation_checkpointing

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)


def _grads(model, how, precision, seed=1):
    """Gradients of one step, and the next random number the run would draw."""
    for b in model.blocks:
        b.recompute = {"none": None, "ours": recompute.checkpoint,
                       "torch": lambda fn, x: torch_checkpoint.checkpoint(fn, x, use_reentrant=False)}[how]
    torch.manual_seed(seed)
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        _, loss = model(x, y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], torch.rand(3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_equals_no_checkpoint_and_torch(precision):
    torch.manual_seed(0)
    model = GPT(CFG)  # dropout 0.1: the recomputed forward must draw the same masks
    plain, r0 = _grads(model, "none", precision)
    ours, r1 = _grads(model, "ours", precision)
    theirs, r2 = _grads(model, "torch", precision)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours))  # exactly: the same arithmetic
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
    assert torch.equal(r0, r1) and torch.equal(r1, r2)  # the run's RNG stream continues unchanged


def test_without_rng_replay_the_gradients_differ(monkeypatch):
    # the check above can fail: recompute with fresh dropout masks and it does
    torch.manual_seed(0)
    model = GPT(CFG)
    plain, _ = _grads(model, "none", "fp32")
    monkeypatch.setattr(recompute, "_rng_state", lambda device: {"cpu": torch.get_rng_state()})
    monkeypatch.setattr(torch, "set_rng_state", lambda s: None)
    broken, _ = _grads(model, "ours", "fp32")
    assert not all(torch.equal(a, b) for a, b in zip(plain, broken))


def test_checkpoint_keeps_only_the_input_and_works_with_autograd_grad():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    _, loss = model(x, y)
    want = torch.autograd.grad(loss, list(model.parameters()))
    set_activation_checkpointing(model)
    _, loss = model(x, y)
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with torch.no_grad():  # evaluation: no Function, no saved input
        assert model(x)[0].grad_fn is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("B, T, d, H, L, V", [(2, 32, 64, 4, 2, 100), (4, 64, 96, 6, 3, 300),
                                              (1, 128, 128, 2, 1, 1000)])
def test_saved_bytes_match_the_formula(B, T, d, H, L, V, checkpointed, precision):
    cfg = GPTConfig(n_layer=L, n_head=H, n_embd=d, block_size=T, vocab_size=V)
    model = GPT(cfg)
    set_activation_checkpointing(model, checkpointed)
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    counted = M.count_saved_bytes(model, x, y, precision)
    per_block = M.block_activation_bytes(B, T, d, H, precision, checkpointed)
    for b in counted["blocks"]:
        assert b == pytest.approx(per_block, rel=0.05)
    assert counted["rest"] == pytest.approx(M.head_activation_bytes(B, T, d, V, precision), rel=0.05)
    assert counted["total"] == pytest.approx(M.activation_bytes(cfg, B, T, precision, checkpointed), rel=0.05)


def test_one_memory_model_and_its_units():
    """The formulas chapter 09 derives are the ones chapter 08's tables use at scale (the
    same functions, held in minidist.cost_model), and gib() prints GiB."""
    from minidist import cost_model as cm
    for name in ("activation_bytes", "block_activation_bytes", "head_activation_bytes",
                 "zero3_gathered_bytes", "model_state_bytes", "GB"):
        assert getattr(M, name) is getattr(cm, name), name
    assert M.gib(3 * 2**30) == "3.00 GiB" and M.gib(2**30 / 10) == "0.10 GiB"
    assert M.gib(5 * 2**20) == "5.0 MiB"


# ---------------------------------------------------------- the step, on 2 ranks

MODEL_ERROR = 0.10  # the stated error of minidist.memory.step_memory's peak on CPU


def _step_peak(cfg, B, T, stage, checkpointed, precision):
    """(measured, modelled) peak bytes of a train_gpt step (the second: AdamW's state exists)."""
    from minidist.ddp import DDP
    from minidist.compose.build import make_optimizers
    from minidist.train import forward_backward
    before = M.storages_now()
    torch.manual_seed(0)
    model = GPT(cfg)
    set_activation_checkpointing(model, checkpointed)
    ddp = DDP(model, bucket_cap_mb=1.0) if stage == 0 else None
    opts = make_optimizers(model, optimizer="adamw", weight_decay=0.1, lr=1e-3, zero_stage=stage, bucket_cap_mb=1.0)
    x, y = torch.randint(0, cfg.vocab_size, (B, T)), torch.randint(0, cfg.vocab_size, (B, T))
    def step():
        forward_backward(ddp or model, [(x, y)], dist.get_world_size(), ddp or opts[0], None, precision)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    step()  # AdamW's state is made in the first step: measure the second
    with M.measure_peak(before) as m:
        step()
    model_peak = M.step_memory(cfg, B, T, dist.get_world_size(), stage, checkpointed, precision, 1.0)["peak"]
    return m.peak, model_peak


ZERO3 = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)


def _zero3_grads(checkpointed):
    from minidist.zero import zero_optimizer
    torch.manual_seed(0)
    model = GPT(ZERO3)
    set_activation_checkpointing(model, checkpointed)
    opt = zero_optimizer(model, model.parameters(), torch.optim.SGD, 3, lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(2):
        x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    peak = opt.peak_gathered_bytes  # before gathered() below gathers everything
    with opt.gathered():
        return [p.detach().clone() for p in model.parameters()], peak


def _on_two_ranks():
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=512)
    peaks = {(s, ck, p): _step_peak(cfg, 4, 64, s, ck, p)
             for s, ck, p in [(0, False, "fp32"), (1, True, "fp32"), (2, False, "bf16"), (2, True, "fp32")]}
    return peaks, _zero3_grads(False), _zero3_grads(True)


@pytest.fixture(scope="module")
def two_ranks(pool):
    return pool(2).run(_on_two_ranks)


def test_memory_model_predicts_the_measured_peak(two_ranks):
    for peaks, _, _ in two_ranks:
        for case, (measured, modelled) in peaks.items():
            assert modelled == pytest.approx(measured, rel=MODEL_ERROR), case


def test_recomputation_under_zero3_trains_as_without(two_ranks):
    for _, (plain, _), (ckpt, _) in two_ranks:  # dropout on: each rank's own masks, replayed
        assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))


def test_zero3_gathers_what_the_model_says(two_ranks):
    # the parameters ZeRO-3 holds gathered at its peak (padding to 2 ranks aside)
    for _, (_, plain), (_, ckpt) in two_ranks:
        assert plain == ckpt == pytest.approx(M.zero3_gathered_bytes(ZERO3), rel=0.01)
