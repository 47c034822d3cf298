"""Graded checks of exercise 05 (exercises/05_mixed_precision.py), registered with exercises.grade.

The oracle is torch.amp.GradScaler("cpu", ...), run side by side with the scaler under
test on the same steps: a few parameters, a loss whose gradient is known, and inf, -inf
or NaN written into one gradient element after backward on the steps a seeded pattern
picks. Every scale and factor is a power of two, so S * g / S == g exactly and every
comparison is exact. Whether a step was skipped is read off the optimizer (a small SGD
with momentum, written out here, that counts its step() calls). Hysteresis > 1 and
min_scale, which GradScaler lacks, are checked against sequences worked out by hand from
the rule the exercise states, and against that rule written out below (_rule), which
with hysteresis=1 is GradScaler's (tests/test_exercise_05.py shows it).

The agreement of ranks runs where it must: in 2 processes started by
minidist.launch.launch (gloo), one launch for the whole check (see exercises/_harness.py);
each rank injects its own overflows and the others must skip with it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import random

import torch
import torch.distributed as dist

from exercises import _harness as H
from exercises import _rules, _traffic
from exercises.grade import check

FP32_MAX = torch.finfo(torch.float32).max
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
HANG_HINT = ("Every rank must all-reduce its verdict every step, overflow or not, and "
             "nothing else: ranks pair their collectives by order.")
SHAPES = [(6, 4), (4,), (2, 3, 2)]  # parameters with a gradient; one more gets none
KINDS = {".": None, "I": float("inf"), "-": float("-inf"), "N": float("nan")}
LEGEND = "'.' clean, 'I' +inf, '-' -inf, 'N' NaN"


# --------------------------------------------------------------------- the optimizer and the steps

class SGD:
    """SGD with momentum, written out (torch.optim's first optimizer imports torch._dynamo,
    a second per process). To a scaler an optimizer is param_groups and step(); `steps`
    counts the step() calls, so a skipped step is one that did not call it."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9):
        self.param_groups = [{"params": list(params), "lr": lr, "momentum": momentum}]
        self.momentum, self.steps = {}, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        g = self.param_groups[0]
        for p in g["params"]:
            if p.grad is not None:
                b = self.momentum.get(p)
                self.momentum[p] = b = p.grad.clone() if b is None else b.mul_(g["momentum"]).add_(p.grad)
                p.sub_(g["lr"] * b)

    def zero_grad(self):
        for p in self.param_groups[0]["params"]:
            p.grad = None


def _pattern(seed: int, n: int, probs) -> str:
    """n steps, '.' or an overflow kind; the overflow probability changes over the run
    (calm and stormy stretches), one value of `probs` per equal stretch."""
    rng = random.Random(seed)
    return "".join(rng.choice("I-N") if rng.random() < probs[i * len(probs) // n] else "."
                   for i in range(n))


def _drive(scaler, pattern: str, seed: int = 0, rank: int = 0, record=None) -> list[dict]:
    """Train with `scaler` for len(pattern) steps; per step record the scaled loss, the
    gradients right after an explicit unscale_ (on about half of the steps; step()
    unscales on the others), whether the step was skipped, get_scale() after update()
    and the parameters. `pattern` is a string of KINDS, or a list of them per rank.
    Records go into `record` as they come, so a caller learns how far a crash got."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=g)) for s in SHAPES]
    unused = torch.nn.Parameter(torch.zeros(3))  # in the optimizer, never a gradient
    opt = SGD(params + [unused])
    rng = random.Random(seed)
    out = [] if record is None else record
    traffic = _traffic.current()  # on the ranks: each step's collectives, labelled with t
    try:
        for t in range(len(pattern)):
            with traffic.phase_of(t) if traffic is not None else contextlib.nullcontext():
                _drive_step(scaler, pattern, t, rank, g, params, opt, rng, out)
    except ValueError as e:  # a collective with no process group
        if "process group" in str(e) and not dist.is_initialized():
            raise AssertionError(
                f"{e} ({type(e).__name__}). This check runs in one process without a process "
                "group: call a collective only when dist.is_initialized() and "
                "dist.get_world_size() > 1") from None
        raise
    return out


def _drive_step(scaler, pattern, t, rank, g, params, opt, rng, out) -> None:
    """Step t of _drive."""
    kind = pattern[t] if isinstance(pattern, str) else pattern[t][rank]
    coef = [(2 * torch.rand(s, generator=g) - 1) / 8 for s in SHAPES]
    explicit, which, where = rng.random() < 0.5, rng.randrange(len(SHAPES)), rng.random()
    loss = sum((c * p).sum() for c, p in zip(coef, params))  # d loss / d p = c, exactly
    scaled = scaler.scale(loss)
    rec = {"scaled": float(scaled.detach()), "unscaled": None}
    scaled.backward()
    if KINDS[kind] is not None:
        grad = params[which].grad.view(-1)
        grad[int(where * grad.numel())] = KINDS[kind]
    if explicit:
        scaler.unscale_(opt)
        rec["unscaled"] = [p.grad.clone() for p in params]
    before = opt.steps
    scaler.step(opt)
    rec["skipped"] = opt.steps == before
    rec["grads"] = [p.grad.clone() for p in params]  # after step(): unscaled, once
    scaler.update()
    rec["scale"] = float(scaler.get_scale())
    rec["params"] = [p.detach().clone() for p in params]
    opt.zero_grad()
    out.append(rec)


# The exercise's rules, watched in every check and part while the learner's code runs
# (exercises/_rules.py); the grader's own GradScaler, the oracle, runs exempt.
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.scaler",)
RULES = _rules.Rules(apis={"torch.amp.GradScaler": "exercise 05 writes the loss scaler: "
                           "torch's GradScaler is the grader's oracle, not a building block"})


@functools.lru_cache(maxsize=None)  # the same for every implementation graded
def _gradscaler(pattern, init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                seed=0) -> list[dict]:
    with _rules.exempt():
        return _drive(torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                           backoff_factor=backoff_factor,
                                           growth_interval=growth_interval), pattern, seed)


def _rule(pattern: str, init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
          hysteresis=1, min_scale=1.0) -> list[tuple[bool, float]]:
    """The exercise's rule, written out: per step (skipped, S after update())."""
    s, tracker, streak, out = float(init_scale), 0, 0, []
    for kind in pattern:
        if kind != ".":
            tracker, streak = 0, streak + 1
            if streak >= hysteresis:
                if s <= min_scale:
                    raise AssertionError("the grader's pattern reaches min_scale")  # never: see the tests
                s = max(s * backoff_factor, min_scale)
        else:
            tracker, streak = tracker + 1, 0
            if tracker == growth_interval:
                tracker = 0
                s = s * growth_factor if s * growth_factor <= FP32_MAX else s
        out.append((kind != ".", s))
    return out


def _new(impl, **kw):
    return impl.LossScaler(**kw)


# --------------------------------------------------------------------- what went wrong

def _run_length(pattern: str, t: int, overflow: bool) -> int:
    n = 0
    while t - n >= 0 and (pattern[t - n] != ".") == overflow:
        n += 1
    return n


def _scale_hint(pattern: str, t: int, prev: float, got: float, want: float, cfg: dict) -> str:
    """A guess at the mistake behind a wrong S after step t."""
    h, gi = cfg.get("hysteresis", 1), cfg.get("growth_interval", 2000)
    gf, bf = cfg.get("growth_factor", 2.0), cfg.get("backoff_factor", 0.5)
    kind = pattern[t]
    if got < cfg.get("min_scale", 0.0):
        return (f"S fell below min_scale={cfg['min_scale']:g}: back off to "
                "max(S * backoff_factor, min_scale)")
    if kind != ".":
        run = _run_length(pattern, t, True)
        if want < prev and got >= prev:
            what = {"N": "NaN", "-": "-inf", "I": "inf"}[kind]
            if h > 1:
                return (f"this was overflow {run} of a streak and hysteresis={h}: once the streak "
                        f"reaches {h}, back off at this and every further overflow of the streak")
            return (f"a gradient was {what}: an overflow backs off (S * backoff_factor)"
                    + (". NaN and -inf are overflows too: test with torch.isfinite" if kind != "I" else ""))
        if want == prev and got < prev:
            return (f"this was overflow {run} of a streak (a clean step ends a streak) and "
                    f"hysteresis={h}: back off only once the streak reaches {h}")
        if got == prev * bf * bf:
            return "backed off twice in one step"
    else:
        clean = _run_length(pattern, t, False)
        if want > prev and got <= prev:
            return (f"growth_interval={gi} clean steps since the last overflow or growth: grow "
                    "(S * growth_factor)")
        if want == prev and got > prev:
            if prev * gf > FP32_MAX:
                return (f"S * growth_factor = {_fmt(prev * gf)} is above float32's largest value "
                        f"({FP32_MAX:.8g}, torch.finfo(torch.float32).max): refuse that growth")
            return (f"grew though the growth tracker had not reached growth_interval={gi} "
                    f"({clean} clean step(s) in a row here): every overflow, even one that does "
                    "not back off, resets the tracker to 0, and so does a growth")
        if got < prev:
            return "a clean step never lowers S"
    return "by the rules, S moves only by backoff_factor on an overflow and growth_factor on growth"


def _fmt(s: float) -> str:
    """A scale as a person reads it: 2**k for the large and small powers of two."""
    k = math.log2(s) if s > 0 and math.isfinite(s) else 0.5
    return f"2**{int(k)}" if k == int(k) and abs(k) > 16 else f"{s:g}"


def _where(label: str, pattern: str, t: int) -> str:
    ctx = pattern[max(0, t - 19):t + 1]
    return (f"{label}, step {t}: the steps so far, newest last, are "
            f"'{'...' if t >= 20 else ''}{ctx}' ({LEGEND})")


def _compare(label: str, pattern: str, got: list, want: list, cfg: dict) -> None:
    """got, want: per step (skipped, S after update()); fail at the first difference."""
    prev = float(cfg["init_scale"])
    for t, ((g_skip, g_s), (w_skip, w_s)) in enumerate(zip(got, want)):
        if g_skip != w_skip:
            if w_skip:
                what = {"N": "NaN", "-": "-inf", "I": "inf"}.get(pattern[t], "non-finite on another rank")
                raise AssertionError(
                    f"{_where(label, pattern, t)}: a gradient was {what}, yet optimizer.step() "
                    "ran: step() must skip a step whose gradients are not all finite"
                    + (" (NaN and -inf too: torch.isfinite)" if pattern[t] in "N-" else ""))
            raise AssertionError(f"{_where(label, pattern, t)}: every gradient was finite, yet "
                                 "the step was skipped (optimizer.step() was not called)")
        if g_s != w_s:
            raise AssertionError(
                f"{_where(label, pattern, t)}: after update() get_scale() is {_fmt(g_s)}, want "
                f"{_fmt(w_s)} (it was {_fmt(prev)}): {_scale_hint(pattern, t, prev, g_s, w_s, cfg)}")
        prev = w_s


def _trajectory(recs) -> list[tuple[bool, float]]:
    return [(r["skipped"], r["scale"]) for r in recs]


# --------------------------------------------------------------------- the patterns

# hysteresis=1 against GradScaler: (label, pattern, scaler arguments). Their scales stay
# far inside float32 and far above min_scale (tests/test_exercise_05.py makes sure).
RANDOM = [
    ("random overflows, growth_interval=3",
     _pattern(1, 160, (0.1, 0.4, 0.05, 0.25)),
     dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)),
    ("random overflows, growth_factor=4, backoff_factor=0.25, growth_interval=2",
     _pattern(2, 120, (0.3, 0.1, 0.5, 0.15)),
     dict(init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)),
]
CEILING = ("growth_interval=1 from 2**120, long clean runs",
           "." * 20 + "I" + "." * 5 + "NI" + "." * 30 + "-" + "." * 10,
           dict(init_scale=2.0**120, growth_factor=2.0, backoff_factor=0.5, growth_interval=1))
MIN_SCALE_FOR_GRADSCALER = 2.0**-100  # GradScaler has none; far below every trajectory

# hysteresis=2, worked out by hand from the rule (every overflow skips its step):
#   0  I  1024  a lone overflow: streak 1, no backoff
#   1  .  1024  ends the streak; tracker 1
#   2  I  1024  a new streak of 1: no backoff; tracker 0
#   3  I   512  streak 2: back off
#   4  N   256  streak 3: back off again
#   5  .   256  tracker 1
#   6  .   256  tracker 2
#   7  -   256  a lone overflow: no backoff, but the tracker goes back to 0
#   8  .   256  tracker 1
#   9  .   256  tracker 2
#  10  .   512  tracker 3: grow
#  11  I   512  lone
#  12  I   256  streak 2: back off
#  13  .   256  tracker 1
#  14  .   256  tracker 2
#  15  .   512  tracker 3: grow
HYSTERESIS_2 = ("hysteresis=2, growth_interval=3, from 1024", "I.IIN..-...II...",
                dict(init_scale=1024.0, growth_interval=3, hysteresis=2),
                [1024, 1024, 1024, 512, 256, 256, 256, 256, 256, 256, 512, 512, 256, 256, 256, 512])
HYSTERESIS_3 = ("random overflows, hysteresis=3, growth_interval=2",
                _pattern(3, 120, (0.5, 0.2, 0.7, 0.3)),
                dict(init_scale=2.0**12, growth_interval=2, hysteresis=3, min_scale=2.0**-60))

# NaN and -inf, hysteresis=1, no growth (growth_interval=1000), by hand: each halves S.
NONFINITE = ("NaN and -inf gradients", "N.-.N-..", [512, 512, 256, 256, 128, 64, 64, 64])

# Two ranks: per step (rank 0's kind, rank 1's kind); the verdict of the step is an
# overflow when either rank has one.
RANKS = {
    "hysteresis=1": ([".I", "..", "N.", "..", ".-", "II", "..", "..", ".N", "I.", "..", ".."],
                     dict(init_scale=2.0**8, growth_interval=2, hysteresis=1)),
    "hysteresis=2": ([".I", "I.", "..", "N.", "..", ".I", "..", "..", ".N", ".-", "I.", ".."],
                     dict(init_scale=2.0**8, growth_interval=2, hysteresis=2)),
}


# --------------------------------------------------------------------- two ranks

@torch.no_grad()
def reference_unscale_shards(shards: list, scale: float) -> bool:
    """unscale_shards fixed: the verdict all-reduced (MAX) over ranks, on every rank."""
    flag = torch.zeros(1)
    for g in shards:
        g.div_(scale)
        if not bool(torch.isfinite(g).all()):
            flag.fill_(1.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# per case, what each of 2 ranks holds: "." clean shards, a KIND one overflowing shard,
# "0" no shard at all
SHARD_CASES = [(".", "I"), ("N", "."), (".", "."), ("0", "-"), ("0", ".")]


def _shards_part(fns, r, n) -> list:
    out = []
    traffic = _traffic.current()
    for case, kinds in enumerate(SHARD_CASES):
        g = torch.Generator().manual_seed(100 * case + r)
        shards = [] if kinds[r] == "0" else [torch.randn(5, generator=g), torch.randn(3, generator=g)]
        if kinds[r] in KINDS and KINDS[kinds[r]] is not None:
            shards[1][1] = KINDS[kinds[r]]
        want = [t / 4.0 for t in shards]
        with traffic.phase_of(case):
            skip = fns["unscale_shards"](shards, 4.0)
        unscaled = all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(shards, want))
        out.append({"skip": skip, "unscaled": unscaled})
    flow = _verdict_not_carried(
        traffic, [k[r] not in (".", "0") for k in SHARD_CASES], [k == (".", ".") for k in SHARD_CASES],
        lambda c: f"2 ranks, case {c} ({', '.join(f'rank {q}: {k}' for q, k in enumerate(SHARD_CASES[c]))})")
    return {"cases": out, "carried": flow}


def _ranks_part(fns, r, n) -> dict:
    out = {}
    traffic = _traffic.current()
    for label, (steps, kw) in RANKS.items():
        traffic.events.clear()
        recs = _drive(fns["LossScaler"](**kw, min_scale=1.0), steps, seed=5, rank=r)
        out[label] = {"trajectory": _trajectory(recs),
                      "params": torch.cat([p.reshape(-1) for p in recs[-1]["params"]]),
                      "carried": _verdict_not_carried(
                          traffic, [s[r] != "." for s in steps], [s == ".." for s in steps],
                          lambda t: f"2 ranks, {label}, step {t}")}
    return out


def _signature(traffic, phase) -> list:
    """What this rank put into its collectives in `phase`: [(kind, copy of the data)]."""
    return [(e.kind, [d.reshape(-1) for d in (e.data or [])]) for e in traffic.events
            if e.phase == phase and e.kind != "barrier"]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        ka == kb and len(da) == len(db) and all(
            x.shape == y.shape and x.dtype == y.dtype
            and torch.allclose(x.double(), y.double(), rtol=0, atol=0, equal_nan=True)
            for x, y in zip(da, db))
        for (ka, da), (kb, db) in zip(a, b))


def _verdict_not_carried(traffic, overflowed: list, clean: list, where) -> str | None:
    """None when, at every step (or case) where this rank's own gradients overflowed, what
    it put into its collectives differs from what it puts in at a step where no rank's did:
    otherwise the other ranks cannot have learnt of its overflow from the recorded
    collectives (exercises/_traffic.py), and a verdict that agrees all the same came
    another way. Also: a collective at every step, with a process group of 2 ranks."""
    quiet = [_signature(traffic, t) for t, c in enumerate(clean) if c]
    for t, over in enumerate(overflowed):
        mine = _signature(traffic, t)
        if not mine:
            return (f"{where(t)}: this rank issued no collective: with a process group of more "
                    "than one rank every rank issues the same collectives every step, overflow or "
                    "not (the grader records them below torch.distributed's Python)")
        if over and any(_same(mine, q) for q in quiet):
            return (f"{where(t)}: this rank's gradients overflowed, yet what it put into its "
                    "collectives is what it puts in when no gradient overflows: the other rank "
                    "cannot have learnt of it from them. The verdict travels in the recorded "
                    "collectives (a flag, all-reduced), not another way")
    return None


def _preflight(cls) -> str | None:
    """The hint of a stub that raises NotImplementedError on the way through one clean and
    one overflowing step, in this process (no process group): then the launch, seconds
    of starting processes, would only bring back that same hint."""
    try:
        _drive(cls(init_scale=2.0**8), ".I")
    except NotImplementedError as e:
        return str(e)
    except Exception:  # anything else is for the ranks to show
        pass
    return None


_CACHE = H.Cache()


def _results(impl) -> dict:
    def compute():
        fns = {"LossScaler": impl.LossScaler, "unscale_shards": impl.unscale_shards}
        parts = {"ranks": _ranks_part, "shards": _shards_part}
        # a stub scaler: its hint without running it on ranks; the find-the-bug part is
        # shipped code, so it runs whatever the scaler's state
        hint = H.preflight(_preflight, impl.LossScaler)
        if hint is None:
            return H.run_all(parts, fns, {2: ["ranks", "shards"]}, TIMEOUT_S, HANG_HINT, RULES)
        results = H.run_all(parts, fns, {2: ["shards"]}, TIMEOUT_S, HANG_HINT, RULES)
        return {**results, ("ranks", 2): ("notimpl", hint)}
    return _CACHE.get((impl.LossScaler, impl.unscale_shards, TIMEOUT_S), compute)  # tests change the timeout


# --------------------------------------------------------------------- the checks

def _grad_problem(where: str, got: torch.Tensor, want: torch.Tensor, s: float) -> str | None:
    if torch.equal(got, want):
        return None
    if torch.equal(got, want * s):
        return f"{where} is still S times too large: divide it by S = {s:g}, in place"
    if torch.equal(got, want / s):
        return f"{where} was divided by S twice: unscale only once per step"
    i = int((got - want).abs().argmax())
    return f"{where}: element {i} is {got.reshape(-1)[i].item():.6g}, want {want.reshape(-1)[i].item():.6g}"


@check("05", points=2, name="scale() and unscale_(): loss * S, gradients divided by S once, as GradScaler")
def _scale_unscale(impl):
    pattern, kw = "." * 8, dict(init_scale=2.0**10, growth_interval=1000)
    want = _gradscaler(pattern, **kw)
    got = _drive(_new(impl, **kw), pattern)
    s = kw["init_scale"]
    for t, (g, w) in enumerate(zip(got, want)):
        where = f"clean step {t} at S = {s:g}"
        assert g["scaled"] == w["scaled"], (
            f"{where}: scale(loss) is {g['scaled']:.8g}, want loss * S = {w['scaled']:.8g}")
        if w["unscaled"] is not None:
            H.first_problem(_grad_problem(f"{where}: after unscale_(), p{i}.grad", a, b, s)
                            for i, (a, b) in enumerate(zip(g["unscaled"], w["unscaled"])))
        how = "after unscale_() and step()" if w["unscaled"] is not None else \
            "after step() alone (it must unscale when unscale_() was not called this step)"
        H.first_problem(_grad_problem(f"{where}: {how}, p{i}.grad", a, b, s)
                        for i, (a, b) in enumerate(zip(g["grads"], w["grads"])))
        assert g["scale"] == s, \
            f"{where}: get_scale() is {g['scale']:g}, want {s:g} (no overflow, no growth yet)"


@check("05", points=3, name="hysteresis=1, random inf/-inf/NaN: the same S and skipped steps as GradScaler")
def _random_overflows(impl):
    for label, pattern, kw in RANDOM:
        want = _trajectory(_gradscaler(pattern, **kw))
        got = _trajectory(_drive(_new(impl, **kw, min_scale=MIN_SCALE_FOR_GRADSCALER), pattern))
        _compare(label, pattern, got, want, kw)


@check("05", points=1,
       name="skipped steps leave the parameters alone; the others unscale and step as GradScaler's")
def _parameters(impl):
    for label, pattern, kw in RANDOM:
        want = _gradscaler(pattern, **kw)
        got = _drive(_new(impl, **kw, min_scale=MIN_SCALE_FOR_GRADSCALER), pattern)
        s = float(kw["init_scale"])  # the S of step t, the same for both up to here
        for t, (g, w) in enumerate(zip(got, want)):
            where = _where(label, pattern, t)
            if w["unscaled"] is not None and not w["skipped"]:
                H.first_problem(_grad_problem(f"{where}: after unscale_(), p{i}.grad", a, b, s)
                                for i, (a, b) in enumerate(zip(g["unscaled"], w["unscaled"])))
            if not all(torch.equal(a, b) for a, b in zip(g["params"], w["params"])):
                if w["skipped"]:
                    raise AssertionError(
                        f"{where}: the parameters changed in a step whose gradients were not all "
                        "finite: skip optimizer.step() altogether"
                        + (" (NaN and -inf are overflows too: torch.isfinite)" if pattern[t] in "N-" else ""))
                H.first_problem(_grad_problem(f"{where}: after step(), p{i}.grad", a, b, s)
                                for i, (a, b) in enumerate(zip(g["grads"], w["grads"])))
                raise AssertionError(
                    f"{where}: after this clean step the parameters differ from "
                    "GradScaler's: the optimizer must step once on the gradients divided by S once "
                    "(and not at all on a skipped step: momentum remembers it)")
            if (g["skipped"], g["scale"]) != (w["skipped"], w["scale"]):
                return  # S differs from here on: the check of the scales says where and why
            s = w["scale"]


@check("05", points=1, name="growth stops at float32's maximum, as GradScaler's")
def _ceiling(impl):
    label, pattern, kw = CEILING
    want = _trajectory(_gradscaler(pattern, **kw))
    got = _trajectory(_drive(_new(impl, **kw, min_scale=MIN_SCALE_FOR_GRADSCALER), pattern))
    _compare(label, pattern, got, want, kw)


@check("05", points=2, name="hysteresis: back off once consecutive overflows reach it; every overflow skips")
def _hysteresis(impl):
    label, pattern, kw, scales = HYSTERESIS_2
    want = [(k != ".", float(s)) for k, s in zip(pattern, scales)]
    _compare(label, pattern, _trajectory(_drive(_new(impl, **kw), pattern)), want, kw)
    label, pattern, kw = HYSTERESIS_3
    _compare(label, pattern, _trajectory(_drive(_new(impl, **kw), pattern)), _rule(pattern, **kw), kw)


@check("05", points=1, name="NaN and -inf are overflows too")
def _nonfinite(impl):
    label, pattern, scales = NONFINITE
    kw = dict(init_scale=1024.0, growth_interval=1000)
    want = [(k != ".", float(s)) for k, s in zip(pattern, scales)]
    _compare(label, pattern, _trajectory(_drive(_new(impl, **kw), pattern)), want, kw)


def _misuse(scaler) -> dict:
    """GradScaler's behaviour on two misuses, recorded: a second unscale_() in one step
    (GradScaler raises RuntimeError and divides nothing), and update() with no verdict since
    the last update() (GradScaler raises: no inf check was recorded); then one more clean
    step, which must go on as if neither had happened."""
    g = torch.Generator().manual_seed(11)
    p = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    opt = SGD([p])
    out = {}

    def attempt(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - which error, exactly, is the point
            return type(e).__name__
        return None
    c = torch.rand(4, 3, generator=g)
    scaler.scale((c * p).sum()).backward()
    scaler.unscale_(opt)
    once = p.grad.clone()
    out["second"] = attempt(lambda: scaler.unscale_(opt))
    out["divided_again"] = not torch.equal(p.grad, once)
    scaler.step(opt)
    scaler.update()
    before = float(scaler.get_scale())
    out["bare"] = attempt(scaler.update)
    out["moved"] = float(scaler.get_scale()) != before
    scaler.scale((c * p).sum()).backward()
    scaler.step(opt)
    scaler.update()
    out["after"] = (float(scaler.get_scale()), p.detach().clone())
    return out


@functools.lru_cache(maxsize=None)
def _gradscaler_misuse():
    with _rules.exempt():
        return _misuse(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))


@check("05", points=1, name="misuse refused as GradScaler does: a second unscale_() in a step, "
                            "update() without a verdict")
def _misuse_check(impl):
    want = _gradscaler_misuse()
    assert want["second"] == "RuntimeError" and want["bare"] == "AssertionError"  # the oracle itself
    got = _misuse(_new(impl, init_scale=2.0**10, growth_interval=2))
    assert got["second"] == "RuntimeError" and not got["divided_again"], (
        "a second unscale_(optimizer) in the same step "
        + ("raised nothing" if got["second"] is None else f"raised {got['second']}")
        + (" and divided the gradients again" if got["divided_again"] else "")
        + ": GradScaler raises RuntimeError (unscale_() was already called since the last "
        "update()) and leaves the gradients as they are; a gradient divided by S twice is a "
        "silent error")
    assert got["bare"] in ("RuntimeError", "AssertionError") and not got["moved"], (
        "update() with no unscale_() or step() since the last update() "
        + ("raised nothing" if got["bare"] is None else f"raised {got['bare']}")
        + (" and moved S" if got["moved"] else "")
        + ": there is no verdict to act on, and GradScaler refuses (it raises, S unchanged); "
        "counting it as a clean step would grow S on a step that never happened")
    s, params = got["after"]
    assert s == want["after"][0] and torch.equal(params, want["after"][1]), (
        f"after the refused calls, one more clean step leaves S = {s:g} (GradScaler: "
        f"{want['after'][0]:g}) or other parameters: a refused call changes nothing")


# min_scale, by hand: (arguments, pattern; the last step must raise, S after the others)
MIN_SCALE = [
    (dict(init_scale=12.0, min_scale=8.0), "II", [8.0]),  # 12 * 0.5 = 6, held at 8
    (dict(init_scale=32.0, min_scale=8.0, hysteresis=2), "I.IIII", [32.0, 32.0, 32.0, 16.0, 8.0]),
]
REMEDY = ("learning rate", " lr", "--lr", "clip", "bf16", "bfloat16")


@check("05", points=1, name="min_scale: S stops there; an overflow there raises an error saying what to try")
def _min_scale(impl):
    for kw, pattern, scales in MIN_SCALE:
        label = ", ".join(f"{k}={v:g}" for k, v in kw.items())
        recs, raised = [], None
        try:
            _drive(_new(impl, growth_interval=1000, **kw), pattern, record=recs)
        except FloatingPointError as e:
            raised = e
        done = min(len(recs), len(pattern) - 1)  # the steps before the one that must raise
        _compare(label, pattern[:done], _trajectory(recs[:done]),
                 [(k != ".", s) for k, s in zip(pattern, scales)], kw)
        last = len(pattern) - 1
        if raised is None:
            raise AssertionError(
                f"{_where(label, pattern, last)}: no FloatingPointError, though this overflow "
                f"would back off with S already at min_scale={kw['min_scale']:g} (S after each "
                f"step: {[r['scale'] for r in recs]})")
        assert len(recs) == last, (
            f"{_where(label, pattern, len(recs))}: raised {type(raised).__name__} ({raised}), but "
            f"S was {recs[-1]['scale'] if recs else kw['init_scale']:g}: raise only when an "
            "overflow would back off (its streak has reached hysteresis) with S already at "
            "min_scale; above it, back off to max(S * backoff_factor, min_scale)")
        assert any(w in str(raised).lower() for w in REMEDY), (
            f"{label}: the error says {str(raised)!r}; say what to try instead (a lower learning "
            "rate, gradient clipping, bf16): the user reading it has a diverging run")


@check("05", points=1, name="state_dict through torch.save: a new scaler goes on exactly where it stopped")
def _state_dict(impl):
    kw = dict(init_scale=1024.0, growth_interval=3, hysteresis=2)
    # after 'I' the streak is 1 (the next overflow backs off); after '..' the tracker is 2
    # (the next clean step grows): a state without either goes on differently
    for before, after in (("..I", "I..."), ("I..", ".I.I")):
        first = _new(impl, **kw)
        _drive(first, before)
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
        s = first.get_scale()
        want = _trajectory(_drive(first, after))
        second = _new(impl, **{**kw, "init_scale": 2.0})
        buf.seek(0)
        try:
            state = torch.load(buf)  # weights_only: what a checkpoint may hold
        except Exception as e:
            raise AssertionError(f"state_dict() did not load back with torch.load ({e}): "
                                 "keep plain numbers (or tensors) in it") from None
        second.load_state_dict(state)
        label = f"hysteresis=2, growth_interval=3; after '{before}' a fresh scaler loads the state"
        assert second.get_scale() == s, f"{label}: its get_scale() is {second.get_scale():g}, want {s:g}"
        got = _trajectory(_drive(second, after))
        for t, (g, w) in enumerate(zip(got, want)):
            assert g == w, (
                f"{label}; then on '{after}', step {t} ({LEGEND}): (skipped, S) is {g}, the "
                f"original scaler's is {w}: the state must hold the growth tracker and the "
                "overflow streak as well as S")


@check("05", points=2, name="2 ranks, inf/NaN on one rank only: every rank skips and backs off alike")
def _ranks(impl):
    for _, per_rank in H.per_world_size(_results(impl), "ranks", (2,)):
        for label, (steps, kw) in RANKS.items():
            union = "".join(next((k for k in s if k != "."), ".") for s in steps)
            want = _rule(union, **kw)
            shown = " ".join(steps)
            for r, res in enumerate(per_rank):
                got = res[label]["trajectory"]
                for t, (g, w) in enumerate(zip(got, want)):
                    if g == w:
                        continue
                    mine = steps[t][r]
                    other = steps[t][1 - r]
                    where = (f"2 ranks, {label}, rank {r}, step {t} (per step rank 0's and rank "
                             f"1's gradients, {LEGEND}: {shown})")
                    if g[0] != w[0] and mine == "." and other != ".":
                        raise AssertionError(
                            f"{where}: only the other rank overflowed, and this rank stepped: "
                            "all-reduce the overflow flag with ReduceOp.MAX so that every rank "
                            "skips when any rank overflowed")
                    raise AssertionError(f"{where}: (skipped, S) is {g}, want {w}")
            a, b = (res[label]["params"] for res in per_rank)
            assert torch.equal(a, b), f"2 ranks, {label}: the ranks' parameters differ at the end"
            H.first_problem(f"rank {r}, {res[label]['carried']}" if res[label]["carried"] else None
                            for r, res in enumerate(per_rank))


@check("05", points=2, name="find the bug: unscale_shards gives every rank the same verdict (sharded gradients)")
def _unscale_shards(impl):
    for _, per_rank in H.per_world_size(_results(impl), "shards", (2,)):
        for case, kinds in enumerate(SHARD_CASES):
            got = [res["cases"][case] for res in per_rank]
            want = any(k in KINDS and KINDS[k] is not None for k in kinds)
            held = ", ".join(f"rank {r}: " + ("no shard" if k == "0" else
                                              "clean shards" if k == "." else f"a shard with {k}")
                             for r, k in enumerate(kinds))
            for r, res in enumerate(got):
                assert res["unscaled"], (f"2 ranks ({held}): rank {r}'s shards are not its "
                                         "gradients divided by the scale")
                assert res["skip"] == want, (
                    f"2 ranks ({held}): rank {r} says skip={res['skip']}, want {want} on every "
                    "rank. A rank sees only its own shard: if it decides alone, one rank skips "
                    "the step and the other takes it, and their parameters drift apart")
        H.first_problem(f"rank {r}, {res['carried']}" if res["carried"] else None
                        for r, res in enumerate(per_rank))


# hints that several checks share
_HINT_UNSCALE = (
    "unscale_: divide, in place, every gradient the optimizer's param groups hold; decide "
    "the verdict from all of them (torch.isfinite says no to inf, -inf and NaN alike); "
    "with a process group of more than one rank, agree on it in one collective every rank "
    "issues every step, where any rank's overflow wins (a flag, ReduceOp.MAX); remember "
    "that this step is unscaled (a second call refuses).")
_HINT_STEP = (
    "step: unscale first if this step is not unscaled yet; then step the optimizer only on "
    "a clean verdict, and on an overflow leave it alone altogether (no step() call).")
_HINT_UPDATE = (
    "update: no verdict since the last update means nothing to act on: refuse. An overflow "
    "lengthens the streak and restarts the growth count; once the streak has reached "
    "hysteresis, back off (never below min_scale, and already there: a FloatingPointError "
    "that says what to try). A clean step ends the streak and counts towards growth; a "
    "growth restarts the count, and is refused above float32's largest value. Then forget "
    "the verdict.")

# Tiered hints, shown one at a time by `python -m exercises.grade 05 --hint`.
HINTS = {
    "_misuse_check": [
        "GradScaler refuses two misuses before changing anything: a second unscale_() before "
        "update() (the gradients would be divided by S twice: RuntimeError), and update() "
        "with no unscale_() or step() since the last update() (there is no verdict to act "
        "on). What must the scaler remember between its calls to tell?",
        _HINT_UPDATE,
    ],
    "_scale_unscale": [
        'LossScaler.__init__: keep the scale (float(init_scale)), the growth tracker '
        "and the overflow streak (both 0), and this step's verdict (None until unscale_"
        ' decides it) and whether unscale_ ran; then delete this raise and implement '
        'the methods below',
        "scale: return loss * S (S a Python float keeps loss's dtype)",
        'get_scale: return the current scale as a Python float',
        _HINT_UNSCALE,
    ],
    "_random_overflows": [
        "Keep two counters: the growth tracker (clean steps since the last overflow or "
        "growth) and the overflow streak (consecutive overflowing steps up to now). An "
        "overflow grows the streak by one and puts the tracker back to 0; a clean step puts "
        "the streak back to 0 and grows the tracker by one.",
        _HINT_STEP,
        _HINT_UPDATE,
    ],
    "_parameters": [
        _HINT_STEP,
    ],
    "_ceiling": [
        _HINT_UPDATE,
    ],
    "_hysteresis": [
        "Keep two counters: the growth tracker (clean steps since the last overflow or "
        "growth) and the overflow streak (consecutive overflowing steps up to now). Back "
        "off once the streak reaches hysteresis, and again at every further overflow of the "
        "same streak.",
        _HINT_UPDATE,
    ],
    "_nonfinite": [
        "torch.isfinite says no to inf, -inf and NaN alike; inf / S is still inf and NaN / S "
        "still NaN, so you may look before or after dividing.",
        _HINT_UNSCALE,
    ],
    "_min_scale": [
        _HINT_UPDATE,
    ],
    "_state_dict": [
        'state_dict: return a dict of plain numbers: the scale, the growth tracker, the'
        ' overflow streak (the hyperparameters too, if you like, as GradScaler does)',
        'load_state_dict: set the scale and both counters from the dict state_dict() '
        'made',
    ],
    "_ranks": [
        "The verdict must be the same on every rank: all-reduce it as a float flag (1. "
        "overflow, 0. clean) with op=dist.ReduceOp.MAX, on every rank, every step, overflow "
        "or not, when dist.is_initialized() and dist.get_world_size() > 1.",
        _HINT_UNSCALE,
    ],
    "_unscale_shards": [
        "Which gradients can one rank see under ZeRO-2, and which rank decides whether the "
        "step is skipped? Run the shipped code in your head for rank 0 clean, rank 1 inf.",
        "Each rank knows only about its own shards: turn the verdict into a float flag and "
        "dist.all_reduce it with ReduceOp.MAX, on every rank (one with no shard too), when "
        "dist.is_initialized() and dist.get_world_size() > 1.",
    ],
}
