"""Graded checks of exercise 06 (exercises/06_zero.py): ZeRO-1 and ZeRO-2. One run_all per world size (2, 3
ranks) runs every part; a training part trains a small GPT with the learner's optimizer, each rank on its
slice of every batch, and returns the parameters, what the optimizer can reach (memory.py) and the
collectives (events()). Oracles: one process with torch's plain optimizer; the layout written out here."""

import contextlib
import functools
import math

import torch
import torch.distributed as dist

from exercises.grader import Cache, Rules, check, differ, events, first_problem, memory, per_world_size, run_all

_YOURS = "the sharding is yours to write: no torch ZeRO, FSDP or DDP in exercise 06"
RULES = Rules(forbidden=dict.fromkeys(
    ("torch.distributed.optim:ZeroRedundancyOptimizer", "torch.distributed.fsdp:FullyShardedDataParallel",
     "torch.distributed.fsdp:fully_shard", "torch.nn.parallel:DistributedDataParallel"), _YOURS))

WORLD_SIZES = (2, 3)
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung
HANG_HINT = ("Every rank must issue the same reduce-scatters and all-gathers, of the same "
             "sizes, in the same order, and wait only for what it started.")
CFG = dict(n_layer=2, n_head=2, n_embd=20, block_size=8, vocab_size=61)
B, STEPS = 12, 2    # 12 sequences: 2 and 3 ranks x 2 micro-steps divide it
CAP_MB = 0.008      # about 2000 floats per unit: 7 units, some padded at 3 ranks
SLACK = 1024        # bytes of small tensors an optimizer may keep besides its shards
# eps 1e-4: the key projection's bias has an exactly zero gradient (softmax ignores a shift
# shared by all keys), and Adam with a tiny eps would blow its rounding noise up to +-lr
OPTIMIZERS = {"adamw": ("AdamW", dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4)),
              "sgd": ("SGD", dict(lr=0.1, momentum=0.9))}
SPECS = {"zero1": dict(opt="adamw", stage=1, reduce=False, accum=1, collectives="torch",
                       what="AdamW, stage 1, gradients averaged beforehand"),
         "zero1_reduce": dict(opt="sgd", stage=1, reduce=True, accum=2, collectives="minidist",
                              what="SGD, stage 1, reduce_gradients=True, 2 micro-steps, 'minidist'"),
         "zero2": dict(opt="adamw", stage=2, reduce=True, accum=2, collectives="torch",
                       what="AdamW, stage 2, 2 micro-steps, collectives='torch'")}
ACC_NUMEL, ACC_MICRO = 11, 3  # the accumulator's gradient: 11 elements, padded on 2 ranks and on 3


def _model():
    from minidist.model import GPT, GPTConfig
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG))
    m.wpe.weight.requires_grad_(False)  # frozen: neither sharded nor updated
    return m


def _groups(model, opt: str) -> list[dict]:
    """Matrices (the frozen one too), vectors, and ln_f's gain (some ranks hold none of it) at half the lr."""
    params, last = list(model.parameters()), model.ln_f.weight
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2 and p is not last], "weight_decay": 0.0},
            {"params": [last], "weight_decay": 0.0, "lr": OPTIMIZERS[opt][1]["lr"] / 2}]


def _batch(step: int):
    x = torch.randint(0, CFG["vocab_size"], (B, CFG["block_size"]),
                      generator=torch.Generator().manual_seed(step))
    return x, torch.roll(x, -1, dims=1)


@functools.lru_cache(maxsize=None)
def _layout(n: int) -> dict:
    """Trainable parameters in reverse registration order, cut before one that takes a unit over the cap, each
    unit padded to a multiple of n. psi: trainable elements; padded: the units' length; owned[r]: rank r's."""
    numels = [0]  # of each unit
    for p in reversed([p for p in _model().parameters() if p.requires_grad]):
        if numels[-1] and 4 * (numels[-1] + p.numel()) > CAP_MB * 2**20:
            numels.append(0)
        numels[-1] += p.numel()
    chunks = [math.ceil(m / n) for m in numels]
    return {"psi": sum(numels), "padded": n * sum(chunks),
            "owned": [sum(min(max(m - r * c, 0), c) for m, c in zip(numels, chunks)) for r in range(n)]}


def _optimizer(name: str):
    """A new subclass of torch.optim's `name` listing its instances in .made."""
    base = getattr(torch.optim, name)

    class Optimizer(base):
        made = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.made.append(self)
    return Optimizer


def _held(opt, made, model) -> tuple[int, int]:
    """(optimizer state: what no .grad lives in, gradients: what no inner optimizer's state
    holds), in bytes, of the tensors but parameters and 0-dim ones that `opt` can reach."""
    params = list(model.parameters())
    found = memory.reachable([opt, *made, *params], modules={type(opt).__module__})
    found = {k: b for k, (b, t) in found.items() if k not in memory.storages(params) and t.dim()}
    grads = memory.storages([p.grad for p in params]
                            + [v.grad for o in made for g in o.param_groups for v in g["params"]])
    state = memory.storages(v for o in made for s in o.state.values() for v in s.values()
                            if torch.is_tensor(v))
    return (sum(b for k, b in found.items() if k not in grads),
            sum(b for k, b in found.items() if k not in state))


@functools.lru_cache(maxsize=None)
def _one_process(opt: str) -> list:
    """The oracle: one process on the whole batch with the plain optimizer."""
    model = _model()
    o = _optimizer(OPTIMIZERS[opt][0])(_groups(model, opt), **OPTIMIZERS[opt][1])
    for step in range(STEPS):
        for g in o.param_groups if step == STEPS - 1 else []:  # a scheduler's move
            g["lr"] /= 2
        model(*_batch(step))[1].backward()
        o.step()
        o.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train_part(name: str, fns, r: int, n: int) -> dict:
    s = SPECS[name]
    want = _one_process(s["opt"])  # before the learner's code runs here
    model = _model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    cls, alive = _optimizer(OPTIMIZERS[s["opt"]][0]), []  # full-size gradient elements, at each hook
    for p in trainable:  # registered before the optimizer's hooks, so they fire first
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(q.numel() for q in trainable if q.grad is not None)))
    opt = fns["ShardedOptimizer"](_groups(model, s["opt"]), cls, stage=s["stage"],
                                  reduce_gradients=s["reduce"], bucket_cap_mb=CAP_MB,
                                  collectives=s["collectives"], module=model, **OPTIMIZERS[s["opt"]][1])
    ev, out = events(), {"phases": [], "held": []}
    for step in range(STEPS):
        for g in opt.param_groups if step == STEPS - 1 else []:  # a scheduler's move, through it
            g["lr"] /= 2
        for i, (xm, ym) in enumerate(zip(*(t.chunk(n)[r].chunk(s["accum"]) for t in _batch(step)))):
            start, early = len(ev), i < s["accum"] - 1 and s["reduce"]
            with opt.no_sync() if early else contextlib.nullcontext():
                (model(xm, ym)[1] / s["accum"]).backward()
            kind = "no_sync" if early and s["stage"] == 1 else "backward"
            out["phases"].append((f"step {step + 1}, backward {i + 1}", kind, ev[start:]))
            out["held"].append(_held(opt, cls.made, model)[1])
        if not s["reduce"]:  # ZeroRedundancyOptimizer's contract: averaged beforehand
            for p in trainable:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        start = len(ev)
        opt.step()
        out["phases"].append((f"step {step + 1}, step()", "step", ev[start:]))
        if step == STEPS - 1:
            out["state"], after = _held(opt, cls.made, model)
            out["held"].append(after)
        opt.zero_grad()
    out.update(params=[p.detach().clone() for p in model.parameters()], peak=max(alive, default=0),
               inner=len(cls.made), want=want, lrs=[g.get("lr") for g in opt.param_groups])
    return out


def _order_part(fns, r: int, n: int) -> dict:
    """Stage 2, one unit per parameter (c, b, a: 12, 20, 10 elements); backward completes units 2, 1, 0."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(*shape)) for shape in ((5, 2), (4, 5), (3, 4)))
    opt = fns["ShardedOptimizer"]([a, b, c], _optimizer("SGD"), stage=2, bucket_cap_mb=0,
                                  collectives="torch", lr=0.1)
    ev, issued, g = events(), [], torch.Generator().manual_seed(7 + r)
    for _ in range(2):
        start = len(ev)
        (torch.tanh(torch.tanh(torch.randn(4, 3, generator=g) @ c) @ b) @ a).square().mean().backward()
        issued.append([sum(math.prod(s) for s in e.shapes) for e in ev[start:]
                       if e.kind.startswith(("reduce_scatter", "all_reduce"))])
        opt.step()
        opt.zero_grad()
    return {"issued": issued, "units": [-(-p.numel() // n) * n for p in (c, b, a)]}


class ReferenceGradAccumulator:
    """ShardedGradAccumulator, as it should be."""

    def __init__(self, numel: int, group=None):
        self.group, self.world = group, dist.get_world_size(group)
        self.chunk = -(-numel // self.world)
        self.shard = torch.zeros(self.chunk)

    @torch.no_grad()
    def reduce(self, flat_grad: torch.Tensor) -> None:
        out, pad = torch.empty(self.chunk), self.chunk * self.world - flat_grad.numel()
        dist.reduce_scatter_single(out, torch.nn.functional.pad(flat_grad, (0, pad)), group=self.group)
        self.shard += out / self.world

    def zero(self) -> None:
        self.shard.zero_()


def _accumulator_part(fns, r: int, n: int) -> list:
    """Two steps of ACC_MICRO micro-steps: (this rank's shard, its slice of all gradients summed, over n)."""
    acc, chunk, out = fns["ShardedGradAccumulator"](ACC_NUMEL), -(-ACC_NUMEL // n), []
    for step in range(2):
        grads = torch.randn(n, ACC_MICRO, ACC_NUMEL, generator=torch.Generator().manual_seed(step))
        for g in grads[r] / ACC_MICRO:
            acc.reduce(g.clone())
        whole = torch.nn.functional.pad(grads.sum((0, 1)) / ACC_MICRO / n, (0, chunk * n - ACC_NUMEL))
        out.append((acc.shard.clone(), whole[r * chunk:(r + 1) * chunk]))
        acc.zero()
    return out


PARTS = {"accumulator": _accumulator_part, "order": _order_part,
         **{k: functools.partial(_train_part, k) for k in SPECS}}
PLAN = {2: ["accumulator", *SPECS, "order"], 3: list(SPECS)}  # a part that fails on 2 ranks is not run on 3
_CACHE = Cache()


def _part(impl, name, world_sizes=None):
    """(n, r, rank r's results) of part `name` on each world size; all parts run once per implementation."""
    fns = {k: getattr(impl, k) for k in ("ShardedOptimizer", "ShardedGradAccumulator")}
    results = _CACHE.get((*fns.values(), WORLD_SIZES, TIMEOUT_S), lambda: run_all(
        PARTS, fns, {n: PLAN[n] for n in WORLD_SIZES}, TIMEOUT_S, HANG_HINT))
    for n, per_rank in per_world_size(results, name, world_sizes or WORLD_SIZES):
        yield from ((n, r, res) for r, res in enumerate(per_rank))


def _equivalence(impl, name):
    """Every rank's parameters after the steps == one process's on the whole batch."""
    for n, r, res in _part(impl, name):
        first_problem(differ(f"on {n} ranks, rank {r}, {SPECS[name]['what']}: after {STEPS} steps {k}", g, w,
                             "one process's on the whole batch", atol=1e-6)
                      for (k, _), g, w in zip(_model().named_parameters(), res["params"], res["want"]))


@check("06", 3, "ZeRO-1, gradients averaged beforehand (ZeroRedundancyOptimizer's "
                "contract): == one process on 2 and 3 ranks (AdamW, param groups)", hints=[
    "What does the inner optimizer see? Views into u.shard, with .grad the matching views of u.grad_shard: "
    "one group per param group passed in (a placeholder where this rank holds none of it), each with its "
    "group's settings.",
    "step: this rank's slice of u.flat_grads() into the shards (unless the optimizer reduces them itself), "
    "the inner step, then every unit's all-gather of its shard into u.flat."])
def _zero1(impl):
    _equivalence(impl, "zero1")
    want = [g.get("lr", OPTIMIZERS["adamw"][1]["lr"]) / 2 for g in _groups(_model(), "adamw")]
    for n, r, res in _part(impl, "zero1"):
        assert res["lrs"] == want, (f"on {n} ranks, rank {r}: opt.param_groups' learning rates are "
                                    f"{res['lrs']}, want {want}, one per param group passed in")


@check("06", 2, "optimizer state: AdamW's 8 bytes per element of this rank's shard "
                "(8 x padded/N), not of the whole model", hints=[
    "Which tensors does the inner optimizer keep state for? Those it was built on: views of this rank's "
    "shards only, never the model's parameters."])
def _state_memory(impl):
    for n, r, res in _part(impl, "zero1"):
        lay, where = _layout(n), f"on {n} ranks, rank {r}, {SPECS['zero1']['what']}"
        assert res["inner"] >= 1, f"{where}: optimizer_class was never called"
        lo, hi = 8 * lay["owned"][r], 8 * lay["padded"] // n
        assert lo <= res["state"] <= hi + SLACK, (
            f"{where}: after the last step the tensors your optimizer can reach hold {res['state']} bytes "
            f"that are neither parameters nor gradients; want AdamW's state of this rank's shards, from "
            f"8 x {lay['owned'][r]} = {lo} (its elements that are not padding) to 8 x padded/N = 8 x "
            f"{lay['padded']}/{n} = {hi} bytes (+{SLACK}); the whole model's is {8 * lay['psi']}")


@check("06", 2, "ZeRO-1, reduce_gradients=True (reduce-scatter after backward, "
                "no_sync accumulation): == one process (SGD with momentum)", hints=[
    "Who averages the gradients now? The optimizer: per unit, an averaging reduce-scatter of its flat "
    "local gradients into a shard-sized tensor, added into u.grad_shard.",
    "The hook counts completed gradients; the first of each backward queues _end_of_backward on "
    "autograd's engine, where stage 1 reduces every unit and finish_gradient_synchronization waits. "
    "Inside no_sync() the hook does nothing."])
def _zero1_reduce(impl):
    _equivalence(impl, "zero1_reduce")


@check("06", 3, "ZeRO-2 (each unit reduce-scattered during backward), with "
                "accumulation: == one process (AdamW)", hints=[
    "When may a unit's reduce-scatter start? Once its last gradient is complete, during backward, and "
    "not before the units ahead of it in index order.",
    "Stage 2 reduces every micro-step (its full gradients are freed), so the shard is where micro-steps "
    "add up; zero_grad is what empties it."])
def _zero2(impl):
    _equivalence(impl, "zero2")


@check("06", 2, "ZeRO-2 gradient memory: full gradients freed during backward, "
                "4 x padded/N bytes of gradients per rank after it", hints=[
    "What keeps a full-size gradient alive once its unit's reduce-scatter has started? Drop the unit's "
    "p.grad as soon as u.flat_grads() has copied them, not at the end of backward; keep no flat copy "
    "after the wait."])
def _grad_memory(impl):
    for n, r, res in _part(impl, "zero2"):
        lay, where = _layout(n), f"on {n} ranks, rank {r}, {SPECS['zero2']['what']}"
        hi = 4 * lay["padded"] // n
        for i, held in enumerate(res["held"]):
            when = "after the step" if i == len(res["held"]) - 1 else f"after backward {i + 1}"
            assert held <= hi + SLACK, (
                f"{where}: {when}, the tensors your optimizer can reach hold {held} bytes of gradients "
                f"(neither parameters nor optimizer state); want the shards', 4 x padded/N = 4 x "
                f"{lay['padded']}/{n} = {hi} (+{SLACK})")
        assert res["peak"] <= lay["psi"] // 2, (
            f"{where}: at one moment of backward {res['peak']} of the {lay['psi']} gradient elements were "
            f"alive as full-size p.grad; want at most half, {lay['psi'] // 2}")


@check("06", 2, "bytes: each unit reduce-scattered once a backward (not inside "
                "no_sync at stage 1), all-gathered once a step: (N-1)/N of it each on a ring", hints=[
    "How many collectives per unit per step? One reduce-scatter (per micro-step at stage 2) and one "
    "all-gather; an all-reduce moves twice a reduce-scatter's bytes.",
    "collectives='minidist' sends everything through minidist.comm; inside no_sync() stage 1 sends "
    "nothing: the last micro-step reduces the accumulated gradients once."])
def _bytes(impl):
    for name in ("zero1_reduce", "zero2"):
        for n, r, res in _part(impl, name):
            P = 4 * _layout(n)["padded"]  # bytes of all the units, padding included
            ring = P * (n - 1) // n       # what a ring reduce-scatter (or all-gather) sends
            if SPECS[name]["collectives"] == "minidist":
                want = {"backward": {"send": [ring, 0], "recv": [0, ring]}, "no_sync": {},
                        "step": {"send": [ring, 0], "recv": [0, ring]}}
            else:  # torch's: a unit's gradient in, 1/N of it out; a shard in, the unit out
                want = {"backward": {"reduce_scatter_tensor": [P, P // n]},
                        "step": {"all_gather_into_tensor": [P // n, P]}}
            for phase, kind, evs in res["phases"]:  # {kind: [bytes sent, bytes received]} of the phase
                got = {k: [sum(x) for x in zip(*((e.sent, e.received) for e in evs if e.kind == k))]
                       for k in dict.fromkeys(e.kind for e in evs)}
                assert got == want[kind], (
                    f"on {n} ranks, rank {r}, {SPECS[name]['what']}, {phase}"
                    f"{' (inside no_sync())' if kind == 'no_sync' else ''}: the collectives carried {got} "
                    f"bytes [sent, received]; want {want[kind]} (the units hold 4 x padded = {P} bytes; a "
                    f"ring sends (N-1)/N of them: {ring})")


@check("06", 2, "reduce order: units reduce-scattered in unit index order on every "
                "rank, even when backward completes them in another order", hints=[
    "In what order do ranks pair collectives (chapter 03, section 4), and in what order does autograd "
    "promise the gradients?",
    "Keep the index of the next unit to start; after each hook start units from there while they are "
    "complete. At the end of backward start the rest, in order, complete or not."])
def _reduce_order(impl):
    for n, r, res in _part(impl, "order", (2,)):
        for i, got in enumerate(res["issued"]):
            assert got == res["units"], (
                f"on {n} ranks, rank {r}, backward {i + 1}: stage 2, one unit per parameter, a model whose "
                f"backward completes units 2, 1, 0 in that order: reduce-scatters of {got} elements, in that "
                f"order; want one per unit, in unit index order, {res['units']}")


@check("06", 2, "find the bug: ShardedGradAccumulator's shard == its slice of the "
                "whole batch's gradient, averaged over ranks", hints=[
    "Follow one rank's shard through three micro-steps: what does it hold after the second reduce(), "
    "and where is the first micro-step's gradient then?",
    "Under ZeRO-2 the full gradients are freed after each micro-step: the shard is the only place "
    "micro-steps can add up."])
def _accumulator(impl):
    for n, r, steps in _part(impl, "accumulator", (2,)):
        first_problem(differ(f"{n} ranks, {ACC_MICRO} micro-steps, before optimizer step {step + 1}: rank {r}'s shard",
                             got, want, f"the {ACC_MICRO} micro-steps' gradients of every rank summed, over {n}", atol=1e-6)
                      for step, (got, want) in enumerate(steps))
