"""Graded checks of exercise 05: the scaler against torch.amp.GradScaler("cpu") on the same steps (inf, -inf
or NaN written into one gradient where a seeded pattern says; powers of two, so every comparison is exact);
what GradScaler lacks (hysteresis > 1, min_scale) against the rule written out (`_rule`)."""

import functools
import importlib
import io
import math
import random
from types import SimpleNamespace

import torch

from exercises.grader import Cache, Rules, check, differ, first_problem, per_world_size, run_all
from minidist.scaler import LossScaler

FP32_MAX = torch.finfo(torch.float32).max
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung
_CACHE = Cache()  # the 2-rank parts' results, of the implementation graded last
HANG_HINT = "Every rank must issue the same collectives every step, overflow or not."
SHAPES = [(6, 4), (4,), (2, 3, 2)]  # parameters with a gradient; one more gets none
KINDS = {".": None, "I": float("inf"), "-": float("-inf"), "N": float("nan")}
LEGEND = "'.' clean, 'I' +inf, '-' -inf, 'N' NaN"
_HELD = {**{k: f"a shard with {v}" for k, v in KINDS.items()}, "0": "no shard", ".": "clean shards"}
_INSTEAD = "exercise 05 writes the loss scaler: torch's GradScaler is the grader's oracle"
RULES = Rules(forbidden={f"{m}:GradScaler": _INSTEAD for m in ("torch.amp", "torch.cuda.amp", "torch.cpu.amp")
                         if hasattr(importlib.import_module(m), "GradScaler")})


def _sgd(params):
    """torch's SGD, lr 0.1, momentum 0.9; `steps` counts its step() calls (a skipped step makes none)."""
    opt = torch.optim.SGD(list(params), lr=0.1, momentum=0.9)
    opt.steps = 0
    opt.register_step_post_hook(lambda o, *_: setattr(o, "steps", o.steps + 1))
    return opt


def _pattern(seed: int, n: int, probs) -> str:
    """n steps, '.' or an overflow kind, the overflow probability changing over the run."""
    rng = random.Random(seed)
    return "".join(rng.choice("I-N") if rng.random() < probs[i * len(probs) // n] else "." for i in range(n))


def _drive(scaler, pattern, seed: int = 0, rank: int = 0, out=None) -> list[dict]:
    """Train with `scaler` on `pattern` (KINDS, or per step per rank); record each step (half unscale_())."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=g)) for s in SHAPES]
    opt = _sgd(params + [torch.nn.Parameter(torch.zeros(3))])
    rng, out = random.Random(seed), [] if out is None else out
    for kind in (pattern if isinstance(pattern, str) else [s[rank] for s in pattern]):
        coef = [(2 * torch.rand(s, generator=g) - 1) / 8 for s in SHAPES]
        explicit, which, where = rng.random() < 0.5, rng.randrange(len(SHAPES)), rng.random()
        scaled = scaler.scale(sum((c * p).sum() for c, p in zip(coef, params)))  # d/dp = c
        rec = {"scaled": float(scaled.detach()), "unscaled": None}
        scaled.backward()
        if KINDS[kind] is not None:
            params[which].grad.view(-1)[int(where * params[which].numel())] = KINDS[kind]
        if explicit:
            scaler.unscale_(opt)
            rec["unscaled"] = [p.grad.clone() for p in params]
        before = opt.steps
        scaler.step(opt)
        rec.update(skipped=opt.steps == before, grads=[p.grad.clone() for p in params])
        scaler.update()
        rec.update(scale=float(scaler.get_scale()), params=[p.detach().clone() for p in params])
        out.append(rec)
        for p in params:
            p.grad = None
    return out


@functools.lru_cache(maxsize=None)  # the same for every implementation graded
def _gradscaler(pattern, **kw) -> list[dict]:
    return _drive(torch.amp.GradScaler("cpu", **kw), pattern)


def _rule(pattern: str, init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
          hysteresis=1, min_scale=1.0) -> list:
    """Per step (skipped, S after update()); (True, None) where the scaler must raise, and nothing after."""
    s, tracker, streak, out = float(init_scale), 0, 0, []
    for kind in pattern:
        overflow = kind != "."
        tracker, streak = (0, streak + 1) if overflow else (tracker + 1, 0)
        if overflow and streak >= hysteresis:
            if s <= min_scale:
                return out + [(True, None)]
            s = max(s * backoff_factor, min_scale)
        if tracker == growth_interval:  # growth_interval clean steps in a row
            tracker, s = 0, s * growth_factor if s * growth_factor <= FP32_MAX else s
        out.append((overflow, s))
    return out


def _trajectory(recs) -> list:
    return [(r["skipped"], r["scale"]) for r in recs]


def _fmt(s: float) -> str:
    k = math.log2(s) if s > 0 and math.isfinite(s) else 0.5
    return f"2**{int(k)}" if k == int(k) and abs(k) > 16 else f"{s:g}"


def _where(label: str, pattern, t: int) -> str:
    ctx = "".join(pattern[max(0, t - 19):t + 1])
    return f"{label}, step {t} (the steps so far, newest last: '{'...' * (t >= 20)}{ctx}', {LEGEND})"


def _compare(label: str, pattern, got: list, want: list, init_scale: float) -> None:
    """Fail at the first step where (skipped, S after update()) differ."""
    for t, (g, w) in enumerate(zip(got, want)):
        assert g == w, (f"{_where(label, pattern, t)}: (skipped, get_scale() after update()) is "
                        f"({g[0]}, {_fmt(g[1])}), want ({w[0]}, {_fmt(w[1])}); S was "
                        f"{_fmt(want[t - 1][1] if t else init_scale)} before this step")


def _follows(impl, case, want, **kw) -> list[dict]:
    """The learner's scaler driven on case (label, pattern, arguments), compared with `want` step by step."""
    label, pattern, args = case
    got = _drive(impl.LossScaler(**args, **kw), pattern)
    _compare(label, pattern, _trajectory(got), want, args["init_scale"])
    return got


# hysteresis=1 against GradScaler: (label, pattern, arguments); S stays far from 1 and from
# float32's maximum, so min_scale=2**-100 never matters
RANDOM = [("random overflows, growth_interval=3", _pattern(1, 96, (0.1, 0.4, 0.05, 0.25)),
           dict(init_scale=2.0**16, growth_interval=3)),
          ("random overflows, growth_factor=4, backoff_factor=0.25, growth_interval=2",
           _pattern(2, 80, (0.3, 0.1, 0.5, 0.15)),
           dict(init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=2))]
LOW = 2.0**-100
CEILING = ("growth_interval=1 from 2**120, long clean runs", "." * 20 + "I" + "." * 5 + "NI" + "." * 30 + "-"
           + "." * 10, dict(init_scale=2.0**120, growth_interval=1))
HYSTERESIS = [("hysteresis=2, growth_interval=3, from 1024", "I.IIN..-...II...",
               dict(init_scale=1024.0, growth_interval=3, hysteresis=2)),
              ("random overflows, hysteresis=3, growth_interval=2", _pattern(3, 80, (0.5, 0.2, 0.7, 0.3)),
               dict(init_scale=2.0**12, growth_interval=2, hysteresis=3, min_scale=2.0**-60))]
MIN_SCALE = [(dict(init_scale=12.0, min_scale=8.0), "II"),
             (dict(init_scale=32.0, min_scale=8.0, hysteresis=2), "I.IIII")]
REMEDY = ("learning rate", " lr", "--lr", "clip", "bf16", "bfloat16")
# 2 ranks: per step rank 0's kind and rank 1's; a step overflows when either rank's does
RANKS = {"hysteresis=1": ([".I", "..", "N.", "..", ".-", "II", "..", "..", ".N", "I.", "..", ".."],
                          dict(init_scale=2.0**8, growth_interval=2)),
         "hysteresis=2": ([".I", "I.", "..", "N.", "..", ".I", "..", "..", ".N", ".-", "I.", ".."],
                          dict(init_scale=2.0**8, growth_interval=2, hysteresis=2))}
# per case, what each of 2 ranks holds: "." clean shards, a KIND one overflowing shard, "0" none
SHARD_CASES = [(".", "I"), ("N", "."), (".", "."), ("0", "-"), ("0", ".")]


def _union(steps) -> str:
    return "".join(next((k for k in s if k != "."), ".") for s in steps)


@check("05", 2, "scale() and unscale_(): loss * S, gradients divided by S once, as GradScaler", hints=[
    "What must the scaler remember between scale(), unscale_(), step() and update()?",
    "S (a float), the count of clean steps, the overflow streak and this step's verdict (none until "
    "unscale_ decides it); step() unscales only if unscale_() has not run this step."])
def _scale_unscale(impl):
    pattern, kw = "." * 8, dict(init_scale=2.0**10, growth_interval=1000)
    want, got, s = _gradscaler(pattern, **kw), _drive(impl.LossScaler(**kw), pattern), kw["init_scale"]
    for t, (g, w) in enumerate(zip(got, want)):
        at = f"clean step {t} at S = {s:g}"
        assert g["scaled"] == w["scaled"], f"{at}: scale(loss) is {g['scaled']:.8g}, want {w['scaled']:.8g}"
        explicit = w["unscaled"] is not None
        for when, key in (("unscale_()", "unscaled"), ("unscale_() and " * explicit + "step()", "grads")):
            for i, (a, b) in enumerate(zip(g[key] or [], w[key] or [])):
                j = int((a - b).abs().nan_to_num(float("inf")).argmax())
                x, y = a.reshape(-1)[j].item(), b.reshape(-1)[j].item()
                assert torch.equal(a, b), (f"{at}: after {when}, p{i}.grad: element {j} is {x:.6g}, want "
                                           f"{y:.6g} ({x / y if y else float('nan'):g} times it; S = {s:g})")
        assert g["scale"] == s, f"{at}: get_scale() is {g['scale']:g}, want {s:g}"


@check("05", 5, "hysteresis=1, random inf, -inf and NaN: the same S, skipped steps and parameters "
                "as GradScaler", hints=[
    "Which values count as an overflow? Try a NaN and a -inf gradient by hand.",
    "torch.isfinite says no to inf, -inf and NaN alike. An overflow skips optimizer.step(), backs S off "
    "and restarts the count of clean steps; growth_interval clean steps grow S."])
def _random_overflows(impl):
    for label, pattern, kw in RANDOM:
        want = _gradscaler(pattern, **kw)
        got = _follows(impl, (label, pattern, kw), _trajectory(want), min_scale=LOW)
        for t, (g, w) in enumerate(zip(got, want)):
            first_problem(differ(f"{_where(label, pattern, t)}: after this {'skipped ' * w['skipped']}step p{i}",
                                 a, b, "GradScaler's run", 0, 0) for i, (a, b) in enumerate(zip(g["params"], w["params"])))


@check("05", 1, "growth stops at float32's maximum, as GradScaler's", hints=[
    "What is the largest S a float32 loss can be multiplied by?",
    "Refuse a growth that would take S above torch.finfo(torch.float32).max."])
def _ceiling(impl):
    _follows(impl, CEILING, _trajectory(_gradscaler(CEILING[1], **CEILING[2])), min_scale=LOW)


@check("05", 2, "hysteresis 2 and 3: back off once consecutive overflows reach it; every overflow skips",
       hints=["Which counter says how many overflows came in a row, and what resets it?",
              "The streak grows at each overflow, goes back to 0 at a clean step; back off once it has "
              "reached hysteresis, and at every further overflow of that streak."])
def _hysteresis(impl):
    for case in HYSTERESIS:
        _follows(impl, case, _rule(case[1], **case[2]))


def _raised(fn) -> Exception | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - which error is the point
        return e


def _misuse(scaler) -> dict:
    """A second unscale_(), then update() with no verdict: what each raises and changes; then a clean step."""
    p = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(11)))
    opt, out = _sgd([p]), {}
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    once = p.grad.clone()
    out["second"], out["divided_again"] = _raised(lambda: scaler.unscale_(opt)), not torch.equal(p.grad, once)
    scaler.step(opt)
    scaler.update()
    before = float(scaler.get_scale())
    out["bare"], out["moved"] = _raised(scaler.update), float(scaler.get_scale()) != before
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    named = {k: type(out[k]).__name__ if out[k] else None for k in ("second", "bare")}  # the errors
    return {**out, **named, "after": (float(scaler.get_scale()), p.detach().clone())}


@check("05", 1, "misuse refused as GradScaler does: a second unscale_() in a step, update() "
                "without a verdict", hints=[
    "How does the scaler know that unscale_() already ran this step, or that no verdict exists?",
    "Refuse both before changing anything; update() forgets the verdict."])
def _misuse_check(impl):
    want = _misuse(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    got = _misuse(impl.LossScaler(init_scale=2.0**10, growth_interval=2))
    assert got["second"] == want["second"] and not got["divided_again"], (
        f"a second unscale_(optimizer) in a step raised {got['second'] or 'nothing'}"
        f"{' and divided the gradients again' if got['divided_again'] else ''}; GradScaler raises "
        f"{want['second']} and leaves them as they are")
    assert got["bare"] in ("RuntimeError", "AssertionError") and not got["moved"], (
        f"update() with no unscale_() or step() since the last update() raised {got['bare'] or 'nothing'}"
        f"{' and moved S' if got['moved'] else ''}; GradScaler raises {want['bare']} and leaves S as it is")
    (s, p), (ws, wp) = got["after"], want["after"]
    off = "equal to" if torch.equal(p, wp) else f"off by up to {(p - wp).abs().max().item():.3g} from"
    assert s == ws and torch.equal(p, wp), (
        f"then a clean step gives S = {s:g} (GradScaler: {ws:g}) and a parameter {off} GradScaler's")


@check("05", 1, "min_scale: S stops there; an overflow there raises an error saying what to try", hints=[
    "What should happen when S is at min_scale and the gradients still overflow?",
    "Back off to max(S * backoff_factor, min_scale); an overflow that would back off there raises "
    "FloatingPointError, saying what to try."])
def _min_scale(impl):
    for kw, pattern in MIN_SCALE:
        label = ", ".join(f"{k}={v:g}" for k, v in kw.items())
        want = _rule(pattern, growth_interval=1000, **kw)
        last, recs = len(want) - 1, []
        raised = _raised(lambda: _drive(impl.LossScaler(growth_interval=1000, **kw), pattern, out=recs))
        if not isinstance(raised, (FloatingPointError, type(None))):
            raise raised  # not this check's error: for the learner to see
        _compare(label, pattern, _trajectory(recs[:last]), want[:last], kw["init_scale"])
        assert raised is not None, (f"{_where(label, pattern, last)}: no FloatingPointError (S after "
                                    f"each step: {[r['scale'] for r in recs]}; S is at min_scale)")
        assert len(recs) == last, f"{label}: FloatingPointError at step {len(recs)}, want it at step {last}"
        assert any(w in str(raised).lower() for w in REMEDY), (
            f"{label}: the error says {str(raised)!r}: it names nothing to try (a lower learning "
            "rate, gradient clipping, bf16)")


@check("05", 1, "state_dict through torch.save: a new scaler goes on exactly where it stopped", hints=[
    "What besides S decides the next steps?",
    "Save S, the count of clean steps and the overflow streak; load all three."])
def _state_dict(impl):
    kw = dict(init_scale=1024.0, growth_interval=3, hysteresis=2)
    for before, after in (("..I", "I..."), ("I..", ".I.I")):
        first, buf = impl.LossScaler(**kw), io.BytesIO()
        _drive(first, before)
        torch.save(first.state_dict(), buf)
        s, want = first.get_scale(), _trajectory(_drive(first, after))  # the original scaler's next steps
        second = impl.LossScaler(**{**kw, "init_scale": 2.0})
        second.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))  # weights_only: as a checkpoint
        label = f"hysteresis=2, growth_interval=3: a fresh scaler loads the state saved after '{before}'"
        assert second.get_scale() == s, f"{label}: its get_scale() is {second.get_scale():g}, want {s:g}"
        _compare(f"{label}, then on '{after}'", after, _trajectory(_drive(second, after)), want, s)


@torch.no_grad()
def reference_unscale_shards(shards: list, scale: float) -> bool:
    """unscale_shards by minidist's LossScaler."""
    stepped = []
    opt = SimpleNamespace(param_groups=[{"params": [SimpleNamespace(grad=g) for g in shards]}],
                          step=lambda: stepped.append(True))
    LossScaler(init_scale=scale, min_scale=scale).step(opt)
    return not stepped


def _ranks_part(fns, r, n) -> dict:
    return {k: _drive(fns["LossScaler"](**kw), steps, seed=5, rank=r) for k, (steps, kw) in RANKS.items()}


def _shards_part(fns, r, n) -> list:
    out = []
    for case, kinds in enumerate(SHARD_CASES):
        g = torch.Generator().manual_seed(100 * case + r)
        shards = [] if kinds[r] == "0" else [torch.randn(5, generator=g), torch.randn(3, generator=g)]
        if KINDS.get(kinds[r]) is not None:
            shards[1][1] = KINDS[kinds[r]]
        want = [t / 4.0 for t in shards]
        out.append({"skip": fns["unscale_shards"](shards, 4.0)})
        out[-1]["unscaled"] = all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(shards, want))
    return out


def _results(impl) -> dict:  # a stub's NotImplementedError ends its part only: the shipped unscale_shards runs
    return _CACHE.get((impl.LossScaler, impl.unscale_shards), lambda: run_all(
        {"ranks": _ranks_part, "shards": _shards_part}, {"LossScaler": impl.LossScaler, "unscale_shards":
                                                         impl.unscale_shards}, (2,), TIMEOUT_S, HANG_HINT, RULES))


@check("05", 2, "2 ranks, inf/NaN on one rank only: every rank skips and backs off alike", hints=[
    "Rank 1 overflows, rank 0 does not: which of them skips?",
    "Combine the ranks' verdicts in one collective that every rank issues every step.",
    "A float flag (1 overflow, 0 clean), all-reduced with the maximum as its operation."])
def _ranks(impl):
    for _, per_rank in per_world_size(_results(impl), "ranks", (2,)):
        for label, (steps, kw) in RANKS.items():
            want, shown = _rule(_union(steps), **kw), [s + " " for s in steps]
            for r, res in enumerate(per_rank):
                _compare(f"2 ranks, {label}, rank {r} (a step: rank 0's gradients, rank 1's)", shown,
                         _trajectory(res[label]), want, kw["init_scale"])
            first_problem(differ(f"2 ranks, {label}: at the end rank 1's p{i}", y, x, "rank 0's", 0, 0)
                          for i, (x, y) in enumerate(zip(*(res[label][-1]["params"] for res in per_rank))))


@check("05", 2, "find the bug: unscale_shards gives every rank the same verdict (sharded gradients)", hints=[
    "Under ZeRO-2 which gradients can one rank see? Run the code for rank 0 clean, rank 1 inf.",
    "A rank that holds no shard must still reach the verdict, and join what the others do to reach it: "
    "as LossScaler.unscale_ does across ranks."])
def _unscale_shards(impl):
    for _, per_rank in per_world_size(_results(impl), "shards", (2,)):
        for case, kinds in enumerate(SHARD_CASES):
            want = any(KINDS.get(k) is not None for k in kinds)
            held = ", ".join(f"rank {r}: {_HELD[k]}" for r, k in enumerate(kinds))
            bad = [r for r, res in enumerate(per_rank) if not res[case]["unscaled"]]
            assert not bad, f"2 ranks ({held}): rank {bad[0]}'s shards are not its gradients / scale"
            skips = [res[case]["skip"] for res in per_rank]
            assert skips == [want] * len(skips), (f"2 ranks ({held}): unscale_shards returned "
                                                  f"{skips} (by rank), want {want} on every rank")
