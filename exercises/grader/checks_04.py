"""Graded checks of exercise 04 (exercises/04_grad_accum.py).

accumulate() runs on 1 and 2 ranks. The oracle is one process on the whole global batch,
`model(x, y)`. Under DDP (minidist's, built by the grader) a forward pre-hook marks where
each micro-step begins, so the all-reduces of DDP's buckets are counted per micro-step.
"""

import functools
import os

import torch

import minidist.ddp
from exercises.grader import Cache, Rules, check, close, differ, events, first_problem, oracle, per_world_size, run_all
from minidist.model import GPT, GPTConfig

WORLD_SIZES = {1: ["plain"], 2: ["plain", "ddp"]}  # the parts to run at each world size
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=12, vocab_size=64)
B, T = 12, 12          # the global batch: 12 sequences of 12 tokens
K = {1: 3, 2: 2}       # micro-steps per rank, by world size
HANG_HINT = "Every rank must make the same all_reduce calls in the same order."
RULES = Rules(
    collectives=frozenset({"all_reduce"}),
    collective_rule="exercise 04 communicates only with dist.all_reduce",
    forbidden={"torch.nn.parallel:DistributedDataParallel": "use the DDP you are given (minidist's)",
               "minidist.train:forward_backward": "minidist's forward_backward is the answer: "
                                                  "write accumulate yourself"})


# --------------------------------------------------------------------- data and oracles

def _batch():
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
    y = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
    for i in range(B):  # sequence i keeps T - i targets: micro-batches hold unequal counts
        y[i, T - i:] = -1
    return x, y


def _micro_batches(x, y, r: int, n: int, k: int):
    """Micro-step j of rank r: sequences [(j*n + r) * per, ...), as minidist's loader lays out a batch."""
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
    """The whole batch's gradient and loss, and the gradients of two mistakes (averaged over ranks)."""
    m, (x, y) = _gpt(), _batch()
    _, loss = m(x, y)  # the whole global batch: the mean over its unmasked targets
    loss.backward()
    out = {"right": _grads(m), "loss": loss.item(), "micro means loss": 0.0}
    micro = [_micro_batches(x, y, r, n, k) for r in range(n)]
    for r in range(n):  # each micro-batch's mean, averaged over micro-steps and ranks
        for xs, ys in micro[r]:
            mean = m(xs, ys)[1] / (k * n)
            mean.backward()
            out["micro means loss"] += mean.item()
    out["the mean of per-micro-batch means"] = _grads(m)
    for r in range(n):  # each rank divides by its own count, then the ranks average
        count = sum(int((ys != -1).sum()) for _, ys in micro[r])
        for xs, ys in micro[r]:
            (m(xs, ys, reduction="sum")[1] / (count * n)).backward()
    out["each rank's sum over its own token count"] = _grads(m)
    return out


def _grad_problem(got: dict, oracles: dict, n: int) -> str | None:
    for name, w in oracles["right"].items():
        g = got[name]
        if g is None:
            return f"{name}.grad is None after accumulate"
        if close(g, w, atol=1e-7):
            continue
        where = f"{name}.grad differs from the whole batch's gradient"
        for mistake in ("the mean of per-micro-batch means", "each rank's sum over its own token count"):
            if (n > 1 or "rank" not in mistake) and close(g, oracles[mistake][name], atol=1e-7):
                return f"{where}: it is the gradient of {mistake}"
        for ratio in (n, 1 / n) if n > 1 else ():
            if close(g, ratio * w, atol=1e-7):
                return f"{where}: it is {ratio:g} times as large"
        return differ(f"{name}.grad", g, w, "the whole batch's gradient", atol=1e-7)
    return None


# --------------------------------------------------------------------- the part, on every rank

def _from_ddp(e) -> bool:
    return os.path.realpath(e.where.rsplit(":", 1)[0]) == os.path.realpath(minidist.ddp.__file__)


def _accumulate_part(use_ddp: bool, fns: dict, r: int, n: int) -> dict:
    k = K[n]
    oracles = _oracles(n, k)
    model, (x, y) = _gpt(), _batch()
    micro = _micro_batches(x, y, r, n, k)
    starts = []  # len(events()) when each forward begins
    if use_ddp:
        with oracle():  # the grader's DDP: its broadcast of rank 0's weights is not yours
            ddp = minidist.ddp.DDP(model, bucket_cap_mb=0.01)  # several buckets
        model.register_forward_pre_hook(lambda *_: starts.append(len(events())))
        loss = fns["accumulate"](ddp, micro, n, ddp)
    else:
        model.register_forward_pre_hook(lambda *_: starts.append(len(events())))
        loss = fns["accumulate"](model, micro, n, None)
        with oracle():  # what the caller does afterwards
            minidist.ddp.allreduce_gradients_flat(model)
    ends = starts[1:] + [len(events())]
    buckets = [sum(e.kind == "all_reduce" and _from_ddp(e) for e in events()[a:b])
               for a, b in zip(starts, ends)]
    return {"loss": loss if isinstance(loss, float) else repr(loss), "want loss": oracles["loss"],
            "micro means loss": oracles["micro means loss"], "k": k, "buckets per step": buckets,
            "n buckets": len(ddp.buckets) if use_ddp else None,
            "problem": _grad_problem({k_: p.grad for k_, p in model.named_parameters()}, oracles, n)}


PARTS = {"plain": functools.partial(_accumulate_part, False),
         "ddp": functools.partial(_accumulate_part, True)}
_CACHE = Cache()


def _part(impl, name, n):
    key = (impl.accumulate, repr(WORLD_SIZES), TIMEOUT_S)  # tests change the last two
    results = _CACHE.get(key, lambda: run_all(PARTS, {"accumulate": impl.accumulate}, WORLD_SIZES,
                                              TIMEOUT_S, HANG_HINT))
    return next(per_world_size(results, name, (n,)))[1]


def _where(n, ddp=""):
    return f"{n} rank{'s' if n > 1 else ''} x {K[n]} micro-steps{ddp}"


# --------------------------------------------------------------------- the checks

_WEIGHT = [
    "Does a token of a micro-batch with few unmasked targets weigh as much as one of a full "
    "micro-batch in your loss?",
    "Sum the per-token losses (model(x, y, reduction='sum')) and divide by N, the unmasked "
    "targets of the whole global batch: all micro-batches, all ranks.",
    "N is needed before the first backward: each rank counts its own targets and one "
    "dist.all_reduce adds them up. Gradient averaging divides by the world size: scale each "
    "summed loss by world_size / N."]


@check("04", points=2, name="1 rank, 3 micro-batches of unequal token counts: gradient == whole batch's",
       hints=_WEIGHT)
def _one_rank(impl):
    first_problem(f"{_where(1)}: {res['problem']}" if res["problem"] else None
                  for res in _part(impl, "plain", 1))


@check("04", points=2, name="2 ranks x 2 micro-steps under DDP: gradient == whole batch's", hints=_WEIGHT)
def _two_ranks_ddp(impl):
    first_problem(f"{_where(2, ' under DDP')}, rank {r}: {res['problem']}" if res["problem"] else None
                  for r, res in enumerate(_part(impl, "ddp", 2)))


@check("04", points=1, name="2 ranks x 2 micro-steps, ddp=None, averaged after: gradient == whole batch's",
       hints=["With ddp=None the caller averages the gradients over ranks afterwards: what must "
              "p.grad hold on each rank before that?", *_WEIGHT[1:]])
def _two_ranks_plain(impl):
    first_problem(f"{_where(2, ' without DDP')}, rank {r}: {res['problem']}" if res["problem"] else None
                  for r, res in enumerate(_part(impl, "plain", 2)))


@check("04", points=1, name="returns the global batch's mean loss per unmasked target, on every rank", hints=[
    "Which loss do you return: this rank's, a mean of means, or the whole batch's?",
    "The whole batch's mean: the sum of every rank's summed losses, over N.",
    "Sum the summed losses over micro-steps, then one dist.all_reduce adds up the ranks'."])
def _loss(impl):
    for part, n in (("plain", 1), ("plain", 2), ("ddp", 2)):
        for r, res in enumerate(_part(impl, part, n)):
            got, want = res["loss"], res["want loss"]
            where = f"{_where(n, ' under DDP' if part == 'ddp' else '')}, rank {r}"
            assert isinstance(got, float), f"{where}: returned {got}, want a Python float"
            means = " (the mean of per-micro-batch means)" if abs(
                got - res["micro means loss"]) <= 1e-5 * abs(want) else ""
            assert abs(got - want) <= 1e-5 * abs(want), (
                f"{where}: returned {got:.6g}{means}, the global batch's mean loss per unmasked "
                f"target is {want:.6g}")


@check("04", points=1, name="under DDP the gradients are all-reduced once, in the last micro-step",
       hints=["How many times does DDP all-reduce its buckets during one call of accumulate?",
              "Inside ddp.no_sync() a backward all-reduces nothing: gradients add up locally.",
              "Run every micro-step but the last inside ddp.no_sync(), the last outside it; with "
              "ddp=None, contextlib.nullcontext() stands in."])
def _no_sync(impl):
    for r, res in enumerate(_part(impl, "ddp", 2)):
        steps, nb, k = res["buckets per step"], res["n buckets"], res["k"]
        where = f"{_where(2, ' under DDP')}, rank {r}"
        assert len(steps) == k, f"{where}: {len(steps)} forward passes, want one per micro-batch ({k})"
        assert steps[:-1] == [0] * (k - 1) and steps[-1] == nb, (
            f"{where}: DDP all-reduced {steps} of its {nb} buckets in micro-steps 1 to {k}; "
            f"want {[0] * (k - 1) + [nb]}")
