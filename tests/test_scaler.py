"""Dynamic loss scaling (minidist.scaler): the trajectory of torch.amp.GradScaler (and of
the module's PlainScaler) under
injected overflows, hysteresis, min_scale, ranks agreeing on a skip, checkpoints, and fp16
/ bf16 training of the GPT against fp32 over the same steps."""

import random

import pytest
import torch

from minidist import train_gpt
from minidist.scaler import FP32_MAX, LossScaler, PlainScaler, ScaleCollapseError


def _grads(step, n=6):
    return torch.randn(n, generator=torch.Generator().manual_seed(step))


def _drive(scaler, pattern, torch_scaler=None):
    """Run `pattern` (per step: None for clean gradients, or inf/nan to inject) through
    `scaler` on an SGD step; return per step (scale used, skipped?, parameters after)."""
    p = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.SGD([p], lr=0.1)
    out = []
    for step, bad in enumerate(pattern):
        s = scaler.scale(torch.ones(())).item()  # also lazily initialises GradScaler
        g = _grads(step) * s
        if bad is not None:
            g[step % 6] = bad
        p.grad = g
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        out.append((s, torch.equal(p.detach(), before), p.detach().clone()))
        opt.zero_grad()
    return out


@pytest.mark.parametrize("p_overflow, growth_interval, steps, factors", [
    (0.05, 3, 300, (2.0**16, 2.0, 0.5)), (0.3, 2, 300, (2.0**16, 2.0, 0.5)),
    (0.5, 1, 300, (2.0**16, 2.0, 0.5)),
    (0.0, 1, 130, (2.0**16, 2.0, 0.5)),  # reaches fp32's largest power of two
    (0.1, 2, 300, (1000.0, 1.5, 0.7))])  # not powers of two: float32 rounding, as GradScaler
def test_hysteresis_1_matches_torch_gradscaler(p_overflow, growth_interval, steps, factors):
    rng = random.Random(int(100 * p_overflow) + growth_interval)
    pattern = [rng.choice([float("inf"), float("-inf"), float("nan")]) if rng.random() < p_overflow
               else None for _ in range(steps)]
    kw = dict(init_scale=factors[0], growth_factor=factors[1], backoff_factor=factors[2],
              growth_interval=growth_interval)
    ours = _drive(LossScaler(**kw, hysteresis=1, min_scale=2.0**-100), pattern)
    theirs = _drive(torch.amp.GradScaler("cpu", **kw), pattern)
    plain = _drive(PlainScaler(**kw), pattern)  # the module's simple form, before LossScaler
    for other in (theirs, plain):
        assert [o[:2] for o in ours] == [t[:2] for t in other]  # scales and skipped steps
        for (_, _, a), (_, _, b) in zip(ours, other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)  # unscaled gradients stepped alike
    scales = [o[0] for o in ours]
    assert len(set(scales)) > 3  # the pattern exercised both directions, not a constant scale
    if p_overflow == 0:
        assert max(scales) == 2.0**127 and 2.0**128 > FP32_MAX  # growth stopped at fp32's ceiling
    else:
        assert sum(o[1] for o in ours) == sum(b is not None for b in pattern)


def test_hysteresis_2_backs_off_only_on_consecutive_overflows():
    """The rule (DeepSpeed's consecutive hysteresis): every overflow skips its step; the
    scale halves on each overflow that makes the current run of consecutive overflows at
    least `hysteresis` long; a clean step ends the run; growth after growth_interval clean
    steps since the last overflow. Expected values worked out by hand from that rule."""
    O, C = float("inf"), None
    pattern = [O, C, O, C, O, O, O, C, C, C, O, C]
    expected_scale_after = [2**10, 2**10, 2**10, 2**10, 2**10, 2**9, 2**8,
                            2**8, 2**8, 2**9, 2**9, 2**9]
    s = LossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    trace = _drive(s, pattern)
    assert [t[1] for t in trace] == [b is not None for b in pattern]  # every overflow skips
    assert [t[0] for t in trace[1:]] + [s.get_scale()] == expected_scale_after
    assert s.skipped_steps == 6


def test_collapse_at_min_scale_raises_a_clear_error():
    s = LossScaler(init_scale=4.0, min_scale=1.0)
    _drive(s, [float("nan")] * 2)  # 4 -> 2 -> 1: still allowed
    assert s.get_scale() == 1.0
    before = s.state_dict()
    with pytest.raises(ScaleCollapseError, match=r"min_scale=1\.0.*diverging.*--lr.*bf16"):
        _drive(s, [float("nan")])
    assert s.state_dict() == before  # nothing half-updated by the failing step


def test_state_dict_resumes_the_same_trajectory():
    rng = random.Random(7)
    pattern = [float("inf") if rng.random() < 0.3 else None for _ in range(80)]
    kw = dict(growth_interval=2, hysteresis=2)
    whole = _drive(LossScaler(**kw), pattern)
    first = LossScaler(**kw)
    _drive(first, pattern[:37])
    resumed = LossScaler(init_scale=1.0)  # every field comes from the checkpoint
    resumed.load_state_dict(first.state_dict())
    assert [t[:2] for t in _drive(resumed, pattern[37:])] == [t[:2] for t in whole[37:]]


def test_misuse_and_bad_settings_are_refused():
    with pytest.raises(ValueError, match="hysteresis must be an integer >= 1"):
        LossScaler(hysteresis=0)
    with pytest.raises(ValueError, match="min_scale <= init_scale"):
        LossScaler(init_scale=0.5, min_scale=1.0)
    p = torch.nn.Parameter(torch.zeros(2))
    opt, s = torch.optim.SGD([p], lr=1.0), LossScaler()
    p.grad = torch.ones(2)
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="once per step"):
        s.unscale_(opt)  # a second unscale would divide by S twice
    with pytest.raises(RuntimeError, match="no unscale_"):
        LossScaler().update()
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))  # a model cast to fp16
    half.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16 gradients"):
        LossScaler().unscale_(torch.optim.SGD([half], lr=1.0))
    off = LossScaler(enabled=False)  # fp32/bf16: a pass-through
    loss = torch.tensor(3.0)
    assert off.scale(loss) is loss and off.get_scale() == 1.0


def _one_rank_overflows(bad_rank):
    """Each rank: an AdamW step on clean gradients, then a step where only `bad_rank`
    sees an inf (as with sharded gradients). Returns what each rank observed."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**8)
    for step in range(2):
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).sum().mul(
            scaler.get_scale()).backward()
        if step == 1 and dist.get_rank() == bad_rank:
            model.weight.grad[0, 0] = float("inf")
        params = [p.detach().clone() for p in model.parameters()]
        state = {k: v.clone() for k, v in opt.state[model.weight].items()} if step else {}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    unchanged = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    state_same = all(torch.equal(v, opt.state[model.weight][k]) for k, v in state.items())
    return dict(skipped=scaler.skipped_steps, scale=scaler.get_scale(), unchanged=unchanged,
                state_same=state_same and bool(state), weight=model.weight.detach().clone())


def test_an_overflow_on_one_rank_makes_every_rank_skip(pool):
    results = pool(3).run(_one_rank_overflows, 2)  # rank 2 of 3 alone sees the inf
    for r in results:
        assert r["skipped"] == 1 and r["scale"] == 2.0**7
        assert r["unchanged"] and r["state_same"]  # parameters and AdamW moments untouched
        torch.testing.assert_close(r["weight"], results[0]["weight"], rtol=0, atol=0)


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--tokenizer",
        "gpt2-512", "--lr", "3e-3", "--warmup-steps", "2", "--eval-windows", "8",
        "--final-eval-windows", "64", "--sample-tokens", "4", "--log-interval", "1",
        "--device", "cpu", "--steps", "40", "--batch-size", "8", "--eval-interval", "100"]


def test_fp16_and_bf16_train_like_fp32(tmp_path, pool):
    """Same seed, data and steps as fp32. Autocast rounds matmul inputs to 8 (bf16) or 11
    (fp16) significant bits; averaged over the batch's tokens that moves each loss by far
    less than those bits' relative precision (2**-8, 2**-11), so we allow 0.5% per step
    while no step is skipped. A skipped step is a step not taken (1/40 of this run each),
    so the run whose scale is pushed into overflows is held only to its final validation
    loss, within 2%; all of them learn about 1 nat/token (6.24 -> ~5.25)."""
    def run(precision, world, *extra):
        argv = TINY + ["--precision", precision, "--out-dir", str(tmp_path / precision), *extra]
        return train_gpt.main(argv) if world == 1 else pool(world).run(train_gpt.main, argv)[0]
    losses = lambda s: [r["loss"] for r in s["rows"] if "loss" in r]
    ref = run("fp32", 1)
    assert losses(ref)[0] - losses(ref)[-1] > 0.8  # it learns
    bf16 = run("bf16", 1)
    # GradScaler's defaults (2**16, growth every 2000 clean steps), 2 ranks x 2 micro-steps:
    # one overflow check per optimizer step, after the last micro-step
    fp16 = run("fp16", 2, "--grad-accum-steps", "2")
    for r in (bf16, fp16):
        assert losses(r) == pytest.approx(losses(ref), rel=5e-3)
        assert r["val_loss"] == pytest.approx(ref["val_loss"], rel=5e-3)
    assert fp16["skipped_steps"] == 0 and bf16["skipped_steps"] == 0
    # growth every 3 clean steps drives the scale into overflow again and again; under
    # ZeRO-2 each rank sees only its shard of the gradients, yet all must skip together
    eager = run("fp16", 2, "--loss-scale-growth-interval", "3", "--zero-stage", "2")
    scales = [r["loss_scale"] for r in eager["rows"] if "loss_scale" in r]
    assert eager["skipped_steps"] > 0 and max(scales) > scales[0]
    assert any(b < a for a, b in zip(scales, scales[1:]))  # it grew, overflowed and backed off
    first_skip = next(i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a)
    assert losses(eager)[:first_skip] == pytest.approx(losses(ref)[:first_skip], rel=5e-3)
    assert eager["val_loss"] == pytest.approx(ref["val_loss"], rel=0.02)
