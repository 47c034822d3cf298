"""Graded checks of exercise 04 (exercises/04_grad_accum.py), registered with exercises.grade.

accumulate() runs where it must: in 1 and 2 processes started by minidist.launch.launch
(gloo), one launch per world size for every part (see exercises/_harness.py). The oracle
is one process computing the mean loss of the whole global batch in one go, `model(x, y)`,
on every rank alongside. Two wrong gradients are computed too, to say which mistake a
wrong answer makes: the mean of per-micro-batch means, and a loss normalised by each
rank's own token count. Under DDP (minidist's, bucketed, started by the grader) the
grader records each all-reduce (seen below torch.distributed's Python, where every road to
gloo meets: exercises/_traffic.py) and which micro-step it fell in (a forward pre-hook on
the GPT marks where each micro-step begins). Data moved any other way (a process group of
the learner's own, the store, a backend object) scores the part 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from exercises import _harness as H
from exercises import _rules
from exercises.grade import check
from minidist.ddp import DDP, allreduce_gradients_flat
from minidist.model import GPT, GPTConfig

WORLD_SIZES = {1: ["plain"], 2: ["plain", "ddp"]}  # the parts to run at each world size
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=12, vocab_size=64)
B, T = 12, 12          # global batch: 12 sequences of 12 tokens
K = {1: 3, 2: 2}       # micro-steps per rank, by world size
HANG_HINT = "Every rank must make the same all_reduce calls in the same order."


# The exercise's rules, watched in every part while the learner's code runs
# (exercises/_rules.py): the token count travels by dist.all_reduce, nothing else; the
# gradients are the DDP's (or the caller's) business, never torch's DDP.
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.ddp", "minidist.train", "minidist.compose.build", "minidist.train_gpt")
IDEA_ALLOWED = ("minidist.ddp.DDP",)  # what the stub itself hands out
RULES = _rules.Rules(
    allowed=("allreduce", "send", "recv"),
    collective_rule="exercise 04 communicates only through dist.all_reduce",
    apis={_rules.TORCH_DDP: "exercise 04 uses the DDP it is given (minidist's), not torch's"})


# --------------------------------------------------------------------- data and oracles

def _batch():
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
    y = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
    for i in range(B):  # sequence i keeps T - i targets: from 12 down to 1
        y[i, T - i:] = -1
    return x, y


def _micro_batches(x, y, r: int, n: int, k: int):
    """Micro-step j of rank r takes sequences [(j*n + r) * per, ...), as minidist's loader
    lays out a global batch: micro-batches and ranks get very different token counts."""
    per = B // (n * k)
    return [(x[(j * n + r) * per:(j * n + r + 1) * per], y[(j * n + r) * per:(j * n + r + 1) * per])
            for j in range(k)]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _grads(model) -> dict:
    out = {k: p.grad.clone() if p.grad is not None else None for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _oracles(n: int, k: int) -> dict:
    """{"right": (grads, loss), "micro means": grads, "local count": grads}, the last two
    being the gradients (averaged over ranks) of two classic mistakes; and "micro means
    loss", the loss the first mistake reports."""
    m, (x, y) = _gpt(), _batch()
    _, loss = m(x, y)  # the whole global batch: mean over its unmasked targets
    loss.backward()
    out = {"right": (_grads(m), loss.item())}
    micro = [_micro_batches(x, y, r, n, k) for r in range(n)]
    means = 0.0
    for r in range(n):  # the mean of each micro-batch's mean, averaged over ranks
        for xs, ys in micro[r]:
            mean = m(xs, ys)[1] / (k * n)
            mean.backward()
            means += mean.item()
    out["micro means"], out["micro means loss"] = _grads(m), means
    for r in range(n):  # each rank divides by its own token count, then ranks average
        count = sum(int((ys != -1).sum()) for _, ys in micro[r])
        for xs, ys in micro[r]:
            (m(xs, ys, reduction="sum")[1] / (count * n)).backward()
    out["local count"] = _grads(m)
    return out


def _close(got, want, rtol=1e-5, atol=1e-7) -> bool:
    return bool(((got - want).abs() <= atol + rtol * want.abs()).all())


def _grad_problem(got: dict, oracles: dict, n: int) -> str | None:
    want = oracles["right"][0]
    for name, w in want.items():
        g = got[name]
        if g is None:
            return f"{name}.grad is None after accumulate: every micro-step runs backward"
        if _close(g, w):
            continue
        where = f"{name}.grad differs from the whole batch's gradient"
        if _close(g, oracles["micro means"][name]):
            return (f"{where}: it is the mean of per-micro-batch means, which weighs a token "
                    "of a micro-batch with few unmasked targets more than one of a full "
                    "micro-batch. Sum the losses (reduction='sum') and divide by the global "
                    "batch's count of unmasked targets")
        if n > 1 and _close(g, oracles["local count"][name]):
            return (f"{where}: each rank divided by its own token count. Ranks hold "
                    "different numbers of unmasked targets: divide by the global count "
                    "(dist.all_reduce it)")
        for ratio in (n, 1 / n) if n > 1 else ():
            if _close(g, ratio * w):
                return (f"{where}: it is {ratio:g} times the right one. Gradient averaging "
                        "divides by the world size: scale each rank's summed loss by "
                        "world_size / global token count")
        i = int((g - w).abs().argmax())
        return (f"{where}: element {i} is {g.reshape(-1)[i].item():.6g}, want "
                f"{w.reshape(-1)[i].item():.6g}")
    return None


# --------------------------------------------------------------------- recording

class _AllReduces:
    """While active: the data pointer and size of each tensor all-reduced, and micro-step
    marks. The all-reduces are seen by the part's recorder, below torch.distributed's
    Python (exercises/_traffic.py)."""

    def __init__(self):
        self.events, self.carried = [], []

    def _seen(self, e):
        if e.kind == "all_reduce":
            self.events.extend(("all_reduce", t.data_ptr(), t.numel()) for t in e.outputs)
            self.carried.append(([t.data_ptr() for t in e.outputs], e.data or []))

    def theirs(self, buffers: set) -> list:
        """What the learner's own all-reduces (not DDP's buckets) carried, flattened, in order."""
        return [torch.cat([d.double().reshape(-1) for d in data]) if data else torch.zeros(0)
                for ptrs, data in self.carried if not set(ptrs) & buffers]

    def __enter__(self):
        H.traffic().listeners.append(self._seen)
        return self

    def __exit__(self, *exc):
        H.traffic().listeners.remove(self._seen)


# --------------------------------------------------------------------- the parts, run on every rank

def _result(fns, r, n, use_ddp: str) -> dict:
    k = K[n]
    oracles = _oracles(n, k)
    model = _gpt()
    x, y = _batch()
    micro = _micro_batches(x, y, r, n, k)
    out = {"loss": None, "problem": None, "want_loss": oracles["right"][1],
           "micro_means_loss": oracles["micro means loss"]}
    if use_ddp == "ddp":
        with _rules.exempt():  # the grader's DDP broadcasts rank 0's weights
            ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
        buffers = {b.buffer.data_ptr() for b in ddp.buckets}
        rec = _AllReduces()
        model.register_forward_pre_hook(lambda *_: rec.events.append(("forward",)))
        with rec:
            loss = fns["accumulate"](ddp, micro, n, ddp)
        _no_gradients_communicated(rec, buffers, model)
        per_step = []
        for e in rec.events:
            if e[0] == "forward":
                per_step.append(0)
            elif e[1] in buffers and per_step:
                per_step[-1] += 1
        out.update(buckets_per_step=per_step, n_buckets=len(ddp.buckets), k=k)
    else:
        buffers, rec = set(), _AllReduces()
        with rec:
            loss = fns["accumulate"](model, micro, n, None)
        _no_gradients_communicated(rec, buffers, model)
        with _rules.exempt():  # what a caller without DDP does afterwards: the grader's
            allreduce_gradients_flat(model)
    try:
        out["loss"] = float(loss)
    except (TypeError, ValueError):
        out["loss"] = repr(loss)
    out["problem"] = _grad_problem({k_: p.grad for k_, p in model.named_parameters()}, oracles, n)
    out["carried"] = _not_carried(rec.theirs(buffers), oracles["right"][1], n) if n > 1 else None
    return out


def _not_carried(mine: list, mean_loss: float, n: int) -> str | None:
    """None when the sums over ranks of what the learner's all-reduces carried (every
    rank's recorded inputs, added here in the order the ranks issued them) hold the
    global count of unmasked targets and the global loss (summed, or already divided);
    else what is wrong: a count or a loss that reached the ranks another way shows here."""
    everyone = [None] * n
    with _rules.exempt():  # the grader's look at every rank's record
        dist.all_gather_object(everyone, mine)
    if len({len(e) for e in everyone}) != 1:
        return (f"the ranks issued {[len(e) for e in everyone]} all-reduces of their own in "
                "accumulate: every rank issues the same ones, in the same order")
    sums = [sum(e[j] for e in everyone) for j in range(len(mine)) if all(
        e[j].numel() == mine[j].numel() for e in everyone)]
    values = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64)
    x, y = _batch()
    count = float((y != -1).sum())
    total = mean_loss * count

    def found(*candidates):
        return any(bool(((values - c).abs() <= 1e-5 * abs(c) + 1e-9).any()) for c in candidates)
    if not found(count, count / n):
        return (f"the global count of unmasked targets ({count:g}) is not among the sums of what "
                f"your all-reduces carried (the grader adds up what every rank put in each one, "
                f"{values.numel()} numbers): each rank counts its own targets, and the count "
                "travels by dist.all_reduce")
    if not found(total, total / n, mean_loss, mean_loss / n, total * n / count):
        return ("the global batch's loss (summed or divided) is not among the sums of what your "
                "all-reduces carried (the grader adds up what every rank put in each one): the "
                "summed losses travel by dist.all_reduce too")
    return None


_OWN_GRADIENTS = ("exercise 04 never communicates gradients itself: they are the DDP's "
                  "business (or, with ddp=None, the caller's, who averages them afterwards); "
                  "all-reduce only the token count and the losses")


def _no_gradients_communicated(rec, buffers: set, model) -> None:
    """The rule 'never gradients yourself': an all-reduce of the learner's (not one of
    DDP's buckets) as large as the smallest parameter breaks it (the count and the loss
    are a few numbers)."""
    smallest = min(p.numel() for p in model.parameters())
    for e in rec.events:
        if e[0] == "all_reduce" and e[1] not in buffers and e[2] >= smallest:
            w, _ = _rules.current()
            if w is not None:
                w.trip(f"dist.all_reduce of {e[2]} elements (gradients)", _OWN_GRADIENTS)


def _plain_part(fns, r, n):
    return _result(fns, r, n, "plain")


def _ddp_part(fns, r, n):
    return _result(fns, r, n, "ddp")


PARTS = {"plain": _plain_part, "ddp": _ddp_part}

_CACHE = H.Cache()


def _results(impl) -> dict:
    fns = {"accumulate": impl.accumulate}
    key = (impl.accumulate, repr(WORLD_SIZES), TIMEOUT_S)  # tests change the last two
    return _CACHE.get(key, lambda: H.run_all(PARTS, fns, WORLD_SIZES, TIMEOUT_S, HANG_HINT, RULES))


def _part(impl, name, world_sizes):
    return H.per_world_size(_results(impl), name, world_sizes)


# --------------------------------------------------------------------- the checks

def _where(n, what):
    return f"{n} rank{'s' if n > 1 else ''} x {K[n]} micro-steps{what}"


@check("04", points=2, name="1 rank, 3 micro-batches of unequal token counts: gradient == whole batch's")
def _one_rank(impl):
    for n, per_rank in _part(impl, "plain", (1,)):
        H.first_problem(f"{_where(n, '')}: {res['problem']}" if res["problem"] else None
                        for res in per_rank)


@check("04", points=2, name="2 ranks x 2 micro-steps under DDP: gradient == whole batch's")
def _two_ranks_ddp(impl):
    for n, per_rank in _part(impl, "ddp", (2,)):
        H.first_problem(f"{_where(n, ' under DDP')}, rank {r}: {res['problem'] or res['carried']}"
                        if res["problem"] or res.get("carried") else None for r, res in enumerate(per_rank))


@check("04", points=1, name="2 ranks x 2 micro-steps, ddp=None, averaged after: gradient == whole batch's")
def _two_ranks_plain(impl):
    for n, per_rank in _part(impl, "plain", (2,)):
        H.first_problem(f"{_where(n, ' without DDP')}, rank {r}: {res['problem'] or res['carried']}"
                        if res["problem"] or res.get("carried") else None for r, res in enumerate(per_rank))


@check("04", points=1, name="returns the global batch's mean loss per unmasked target, on every rank")
def _loss(impl):
    for part in ("plain", "ddp"):
        for n, per_rank in _part(impl, part, [n for n, parts in WORLD_SIZES.items() if part in parts]):
            for r, res in enumerate(per_rank):
                if res.get("carried"):
                    raise AssertionError(_where(n, " under DDP" if part == "ddp" else "")
                                         + f", rank {r}: {res['carried']}")
                got, want = res["loss"], res["want_loss"]
                where = _where(n, " under DDP" if part == "ddp" else "") + f", rank {r}"
                assert isinstance(got, float), f"{where}: returned {got}, want a Python float"
                if abs(got - want) <= 1e-5 * abs(want):
                    continue
                means = abs(got - res["micro_means_loss"]) <= 1e-5 * abs(want)
                raise AssertionError(
                    f"{where}: returned {got:.6g}, the global batch's mean loss per unmasked "
                    f"target is {want:.6g} (the summed losses of all ranks over the global count)"
                    + (": you returned the mean of per-micro-batch means" if means else ""))


@check("04", points=1, name="DDP all-reduces gradients once, in the last micro-step (no_sync before)")
def _no_sync(impl):
    for n, per_rank in _part(impl, "ddp", (2,)):
        for r, res in enumerate(per_rank):
            steps, nb, k = res["buckets_per_step"], res["n_buckets"], res["k"]
            where = f"{_where(n, ' under DDP')}, rank {r}"
            assert len(steps) == k, f"{where}: {len(steps)} forward passes, want one per micro-batch ({k})"
            for j, c in enumerate(steps[:-1]):
                assert c == 0, (
                    f"{where}: micro-step {j + 1} of {k} all-reduced {c} gradient bucket(s); "
                    "run every micro-step but the last inside ddp.no_sync()")
            assert steps[-1] == nb, (
                f"{where}: the last micro-step all-reduced {steps[-1]} of the {nb} gradient "
                "buckets, want each once: run the last micro-step outside ddp.no_sync()")


# Tiered hints, shown one at a time by `python -m exercises.grade 04 --hint` (moved out of the stub, which poses the problem).
_WEIGHT = (
    "Every token of the global batch must weigh the same. The mean of per-micro-batch "
    "means weighs a token of a short micro-batch more than one of a long micro-batch. Sum "
    "the per-token losses instead (model(x, y, reduction='sum')) and divide by N, the "
    "number of unmasked targets in the whole global batch: all micro-batches, all ranks "
    "(a dist.all_reduce of the count).")
_SCALE = (
    "DDP averages gradients over ranks (divides the sum by the world size). So that the "
    "result is the global batch's mean, scale each rank's summed loss by world_size / N "
    "before backward: the division by world_size undoes the multiplication, and what is "
    "left is the sum over all tokens of the global batch, divided by their number. With "
    "ddp=None prepare the gradients exactly the same way: the caller averages them.")
_NO_SYNC = (
    "Under DDP the earlier micro-steps run inside ddp.no_sync(), where backward "
    "accumulates locally and all-reduces nothing; the last backward, outside it, "
    "all-reduces the accumulated sums once.")
_RECIPE = (
    "Two numbers need every rank: the count of unmasked targets of the global batch and "
    "the sum of the summed losses. Each travels by one dist.all_reduce of a float tensor. "
    "The count is needed before the first backward (it scales every micro-step); the loss "
    "can be summed once the last backward is done. Which micro-steps run inside no_sync(), "
    "and what stands in for it when there is no DDP?")

HINTS = {
    "_one_rank": [_WEIGHT, _SCALE, _NO_SYNC, _RECIPE],
    "_two_ranks_ddp": [_WEIGHT, _SCALE, _NO_SYNC, _RECIPE],
    "_two_ranks_plain": [_WEIGHT, _SCALE, _RECIPE],
    "_loss": [
        "The loss to return is the global batch's mean per unmasked target, the same on "
        "every rank: not the mean of per-micro-batch means, nor this rank's own mean.",
        _WEIGHT, _RECIPE],
    "_no_sync": [_NO_SYNC, _RECIPE],
}
