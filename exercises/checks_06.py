"""Graded checks of exercise 06 (exercises/06_zero.py), registered with exercises.grade.

The sharded optimizer runs where it must: in 2 and 3 processes started by
minidist.launch.launch (gloo), one launch per world size for every part (see
exercises/_harness.py). Each part trains a small GPT (a frozen parameter, an embedding
tied to the head, three param groups, one of which some ranks hold no element of; n_embd
20 and vocabulary 61, so that at 3 ranks the units do not divide and get padded) for a
few steps, each rank on its slice of every batch, halving every group's learning rate
through param_groups before the last step (as a scheduler would). The oracle is one
process training the same model on the whole batch with the plain torch optimizer,
computed on rank 0 in a part of its own.

What each rank holds is measured from the outside, not asked of the optimizer: the
grader hands it an optimizer class that records every instance made (so the state of
whatever inner optimizer it builds is counted), walks every tensor the learner's
optimizer can reach (exercises/_measure.py: its attributes, the inner optimizers, the
model's parameters with their hooks, the learner's module globals; state kept anywhere
counts, not only self.state), registers its own post-accumulate-grad hooks before the
optimizer's (they fire first, and count the full-size gradients alive at each moment of
backward), and collects the storages of every gradient left after backward and after the
step. The expected sizes come from the layout the exercise prescribes, written out here
(_layout): the units' padded lengths, and which of its elements each rank owns.

Every collective and message is recorded below torch.distributed's Python
(exercises/_traffic.py): the bytes on the wire of the collectives="minidist" parts are the
point-to-point messages recorded while backward ran (the reduce-scatters) and in step (the
all-gathers); in the collectives="torch" parts each backward's reduce-scatters must carry
this rank's own gradients (computed alongside on a copy of the model at the same weights);
a model whose backward completes its units out of index order shows the reduce order.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from unittest import mock

import torch
import torch.distributed as dist

from exercises import _harness as H
from exercises import _measure, _rules
from exercises.grade import check

WORLD_SIZES = (2, 3)
STATE_SLACK = 1024  # bytes of small tensors an optimizer may keep besides its state
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
HANG_HINT = ("Every rank must issue the same reduce-scatters and all-gathers, of the same "
             "sizes, in the same order, and wait only for what it started.")
CFG = dict(n_layer=2, n_head=2, n_embd=20, block_size=8, vocab_size=61)
B, STEPS = 12, 3    # 12 sequences: 2 and 3 ranks x 2 micro-steps divide it
CAP_MB = 0.004      # about 1000 floats per unit: several units, some padded at 3 ranks
# eps 1e-4, not 1e-8: the key projection's bias has an exactly zero gradient (softmax
# ignores a shift shared by all keys), so what arrives is rounding noise, which Adam with
# a tiny eps would blow up to +-lr differently for every summation order
OPTIMIZERS = {"adamw": ("AdamW", dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4)),
              "sgd": ("SGD", dict(lr=0.1, momentum=0.9))}


# The parts that train: optimizer, stage, whether the optimizer reduces the gradients
# itself, micro-steps per step, collectives.
SPECS = {
    "zero1": dict(opt="adamw", stage=1, reduce=False, accum=1, collectives="torch"),
    "zero1_reduce": dict(opt="adamw", stage=1, reduce=True, accum=2, collectives="torch"),
    "zero1_reduce_sgd": dict(opt="sgd", stage=1, reduce=True, accum=2, collectives="minidist"),
    "zero2": dict(opt="adamw", stage=2, reduce=True, accum=1, collectives="minidist"),
    "zero2_accum": dict(opt="sgd", stage=2, reduce=True, accum=2, collectives="torch"),
}


def _describe(name: str) -> str:
    s = SPECS[name]
    how = "" if s["stage"] == 2 else ", reduce_gradients=True" if s["reduce"] else \
        ", gradients averaged beforehand"
    return (f"{OPTIMIZERS[s['opt']][0]}, stage {s['stage']}{how}, {s['accum']} micro-step"
            f"{'s' if s['accum'] > 1 else ''}, collectives={s['collectives']!r}")


# --------------------------------------------------------------------- model, data, layout

def _model():
    from minidist.model import GPT, GPTConfig
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG))
    m.wpe.weight.requires_grad_(False)  # a frozen parameter: not sharded, never updated
    return m


def _groups(model, opt: str = "adamw") -> list[dict]:
    """Three param groups: matrices with weight decay (the frozen one among them, as a
    user might pass it), vectors without, and the final LayerNorm's gain at half the
    learning rate: a group that lands at the end of a unit, so that some ranks hold none
    of it (on 2 ranks and on 3)."""
    params = list(model.parameters())  # the tied embedding/head once
    last = {id(model.ln_f.weight)}
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2 and id(p) not in last], "weight_decay": 0.0},
            {"params": [p for p in params if id(p) in last], "weight_decay": 0.0,
             "lr": OPTIMIZERS[opt][1]["lr"] / 2}]


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG["vocab_size"], (B, CFG["block_size"]), generator=g)
    return x, torch.roll(x, -1, dims=1)


@functools.lru_cache(maxsize=None)
def _layout(n: int) -> dict:
    """The exercise's layout, written out: trainable parameters in registration order,
    each once, reversed, cut where the next would take a unit over the cap; each
    unit padded to a multiple of n. psi: trainable elements; padded: all units' lengths;
    owned[r]: the elements of rank r's shards that hold parameters (not padding)."""
    # the grader passes module=model: the units follow the registration order (a tied
    # weight once); the param groups order the parameters only within a unit
    ordered = [p for p in _model().parameters() if p.requires_grad]
    cap, units, size = CAP_MB * 2**20, [[]], 0
    for p in reversed(ordered):
        if units[-1] and size + 4 * p.numel() > cap:
            units.append([])
            size = 0
        units[-1].append(p.numel())
        size += 4 * p.numel()
    numels = [sum(u) for u in units]
    chunks = [math.ceil(m / n) for m in numels]
    return {"psi": sum(numels), "padded": n * sum(chunks), "units": len(units),
            "owned": [sum(max(0, min((r + 1) * c, m) - r * c) for m, c in zip(numels, chunks))
                      for r in range(n)]}


@functools.lru_cache(maxsize=None)
def _fast(name: str):
    """torch.optim's optimizer `name` ("AdamW", "SGD"), its step() the same function
    without the wrapper that imports torch._dynamo on every first step (seconds per rank
    here) only to mark a graph break for a compiler that nothing here runs (and without
    the profiler's wrapper, which runs step hooks; there are none). The same arithmetic:
    the wrappers add nothing else but turning gradients off."""
    base = getattr(torch.optim, name)

    class Optimizer(base):
        @torch.no_grad()
        def step(self, closure=None):
            return inspect.unwrap(base.step)(self, closure)

    Optimizer.__name__ = Optimizer.__qualname__ = name
    return Optimizer


def _recording(opt: str):
    """The inner optimizer's class, recording every instance made."""
    made = []

    class Recorded(_fast(OPTIMIZERS[opt][0])):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    Recorded.__name__ = Recorded.__qualname__ = OPTIMIZERS[opt][0]
    return Recorded, made


def _state_bytes(made) -> int:
    """Bytes of the inner optimizers' per-element state (AdamW's moments, SGD's momentum);
    0-dim tensors (AdamW's step counters, 4 bytes each) left out."""
    return sum(v.numel() * v.element_size() for o in made for s in o.state.values()
               for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def _grad_bytes(made, params) -> int:
    """Bytes of the distinct storages behind every gradient this rank holds: the inner
    optimizers' (views of the gradient shards) and the model's full-size p.grad."""
    storages = {}
    grads = [v.grad for o in made for g in o.param_groups for v in g["params"]]
    for t in grads + [p.grad for p in params]:
        if t is not None:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


# --------------------------------------------------------------------- the parts, run on every rank

def _oracle_part(fns, r: int, n: int):
    """Rank 0: one process on the whole batch with the plain optimizer, each optimizer;
    and, to name a mistake, the same with gradients n times too large (summed, not
    averaged over ranks). The initial parameters too."""
    if r != 0:
        return None
    H.skip_dynamo_import()
    out = {"initial": [p.detach().clone() for p in _model().parameters()]}
    for opt, (cls, kw) in OPTIMIZERS.items():
        for times in (1, n):
            model = _model()
            o = _fast(cls)(_groups(model, opt), **kw)
            for step in range(STEPS):
                x, y = _batch(step)
                if step == STEPS - 1:  # a scheduler's move
                    for g in o.param_groups:
                        g["lr"] /= 2
                (times * model(x, y)[1]).backward()
                o.step()
                o.zero_grad()
            out[opt if times == 1 else f"{opt} x{n}"] = [p.detach().clone() for p in model.parameters()]
    return out


def _train_part(name: str, fns, r: int, n: int) -> dict:
    from minidist.ddp import allreduce_gradients_flat
    s = SPECS[name]
    H.skip_dynamo_import()
    traffic = H.traffic()
    model = _model()
    named = dict(model.named_parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    params_at = _measure.storages(model.parameters())
    cls, made = _recording(s["opt"])
    holds = _Holdings(model, made)
    peak = [0]

    def alive(_):  # a gradient is complete: count the full-size ones held right now
        peak[0] = max(peak[0], sum(p.numel() for p in trainable if p.grad is not None))

    for p in trainable:  # before the optimizer's hooks: ours fire first
        p.register_post_accumulate_grad_hook(alive)
    opt = fns["ShardedOptimizer"](_groups(model, s["opt"]), cls, stage=s["stage"],
                                  reduce_gradients=s["reduce"], bucket_cap_mb=CAP_MB,
                                  collectives=s["collectives"], module=model,
                                  **OPTIMIZERS[s["opt"]][1])
    holds.opt = opt
    _rules.scan_built(model, opt)
    out = {"after_backward": [], "grad_bytes": None, "carried": None}
    per = B // n
    m = per // s["accum"]
    shadow = _model() if s["collectives"] == "torch" and n > 1 else None
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        if step == STEPS - 1:  # a scheduler's move, through the sharded optimizer
            for g in opt.param_groups:
                g["lr"] /= 2
        if shadow is not None:  # this rank's own gradients, at the weights the model has now
            with torch.no_grad():
                for a, b_ in zip(shadow.parameters(), model.parameters()):
                    a.copy_(b_)
        micro = []  # the shadow's gradients of each micro-step
        for i in range(s["accum"]):
            last = i == s["accum"] - 1
            xi, yi = x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]
            with traffic.phase_of(("backward", step, i)):
                with contextlib.nullcontext() if last or not s["reduce"] else opt.no_sync():
                    (model(xi, yi)[1] / s["accum"]).backward()
            out["after_backward"].append([k for k, p in named.items() if p.grad is not None])
            out.setdefault("held_after_backward", []).append(holds.gradient_bytes())
            if shadow is not None:
                shadow.zero_grad(set_to_none=True)
                (shadow(xi, yi)[1] / s["accum"]).backward()
                micro.append([p.grad.clone() for p in shadow.parameters() if p.grad is not None])
        if shadow is not None and s["reduce"] and out["carried"] is None:
            out["carried"] = _not_carried(traffic, step, micro, s["stage"])
        if not s["reduce"]:  # ZeroRedundancyOptimizer's contract: averaged beforehand
            with _rules.exempt():  # by the grader
                allreduce_gradients_flat(model)
        with traffic.phase_of(("step", step)):
            opt.step()
        if step == STEPS - 1:
            out["grad_bytes"] = max(_grad_bytes(made, trainable), holds.gradient_bytes())
        opt.zero_grad()
    sent = {"reduce_scatter": 0, "all_gather": 0, "inside no_sync": 0}
    for e in traffic.events:
        if e.kind == "send":
            early = e.phase[0] == "backward" and e.phase[2] < s["accum"] - 1 and s["stage"] == 1
            sent["inside no_sync" if early else
                 "reduce_scatter" if e.phase[0] == "backward" else "all_gather"] += e.sent
        elif e.kind not in ("recv", "barrier"):
            sent[f"{e.kind} (torch.distributed)"] = sent.get(f"{e.kind} (torch.distributed)", 0) + e.sent
    out.update(params=[p.detach().clone() for p in model.parameters()], peak=peak[0],
               state_bytes=_state_bytes(made), inner=len(made), sent=sent,
               reachable_state=holds.state_bytes(), lrs=[g.get("lr") for g in opt.param_groups])
    del params_at
    return out


class _Holdings:
    """What the learner's optimizer holds, found by walking every reference it (and the
    model's parameters, their hooks, and the learner's module) can reach
    (exercises/_measure.py), not by asking it: the parameters' own storages left out,
    split into gradients (what a parameter's .grad, or an inner optimizer's parameter's
    .grad, lives in) and the rest (optimizer state, wherever it is kept)."""

    def __init__(self, model, made):
        self.model, self.made, self.opt = model, made, None

    def _found(self) -> dict:
        roots = [self.opt, *self.made, *self.model.parameters()]
        mods = {type(self.opt).__module__} if self.opt is not None else set()
        found = _measure.reachable(roots, modules=mods)
        params = _measure.storages(self.model.parameters())
        return {k: v for k, v in found.items() if k not in params}

    def _grads(self) -> set:
        grads = [p.grad for p in self.model.parameters()]
        grads += [v.grad for o in self.made for g in o.param_groups for v in g["params"]]
        return _measure.storages(grads)

    def _state(self) -> set:
        return _measure.storages(v for o in self.made for st in o.state.values()
                                 for v in st.values() if torch.is_tensor(v))

    def state_bytes(self) -> int:
        """Bytes of tensors reachable that hold neither parameters nor gradients (0-dim
        ones, such as AdamW's step counters, left out)."""
        grads = self._grads()
        return sum(nbytes for k, (nbytes, t) in self._found().items()
                   if k not in grads and t.dim() > 0)

    def gradient_bytes(self) -> int:
        """Bytes of tensors reachable that hold neither parameters nor the inner
        optimizers' state (0-dim ones left out): gradients, wherever they are kept."""
        state = self._state()
        return sum(nbytes for k, (nbytes, t) in self._found().items()
                   if k not in state and t.dim() > 0)


def _not_carried(traffic, step: int, micro: list, stage: int) -> str | None:
    """None when the reductions recorded while the backwards of `step` ran (below
    torch.distributed's Python, exercises/_traffic.py) carried this rank's own gradients of
    every trainable parameter: `micro` holds them per micro-step (a copy of the model at
    the same weights, on the same micro-batches). Each micro-step's reductions carry its
    gradients (any order, plus the units' zero padding), or, at stage 1, the last one's
    carry their sum (accumulated under no_sync()). Gradients averaged some other way than
    the recorded reduce-scatters (or all-reduces) show here."""
    def sent(i):
        return [d.reshape(-1) for e in traffic.events if e.phase == ("backward", step, i)
                and e.kind in ("reduce_scatter", "all_reduce") for d in (e.data or [])]

    def holds(got: list, want: list) -> bool:
        if not got:
            return False
        got, want = torch.cat(got), torch.cat([g.reshape(-1) for g in want])
        pad = got.numel() - want.numel()
        return pad >= 0 and _close(got.sort().values, torch.cat([want, want.new_zeros(pad)]).sort().values,
                                   rtol=1e-4, atol=1e-6)
    k = len(micro)
    if all(holds(sent(i), micro[i]) for i in range(k)):
        return None
    if stage == 1 and holds(sent(k - 1), [sum(gs) for gs in zip(*micro)]):
        return None
    where = f"step {step}"
    if not any(sent(i) for i in range(k)):
        return (f"{where}: no reduce-scatter was recorded while backward ran, though the gradients "
                "must be averaged over ranks: with collectives='torch' through torch.distributed's "
                "reduce-scatter, on self.group")
    return (f"{where}: the reduce-scatters recorded while backward ran carried values that are not "
            "this rank's gradients of the trainable elements (and the padding's zeros): the grader "
            "records what each reduce-scatter sends, and the units' local gradients must be in it. "
            "Gradients averaged any other way do not count")


# The exercise's rules, watched in every part while the learner's code runs
# (exercises/_rules.py); torch's ZeroRedundancyOptimizer, the grader's oracle, runs exempt.
_YOURS = "the sharding is yours to write: no torch ZeRO, FSDP or DDP in exercise 06"
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.zero",)
IDEA_ALLOWED = ("minidist.zero.Unit", "minidist.comm", "minidist.ddp.make_buckets")  # what the stub itself imports
RULES = _rules.Rules(apis={"torch.distributed.optim.ZeroRedundancyOptimizer": _YOURS,
                           _rules.TORCH_DDP: _YOURS,
                           **{name: _YOURS for name in _rules.TORCH_FSDP}})


def _zero_redundancy_part(fns, r: int, n: int) -> dict:
    """Ours and torch's ZeroRedundancyOptimizer on the same model and data: the whole
    batch on every rank (so the gradients are "averaged" already), a plain parameter list."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    H.skip_dynamo_import()
    out = {}
    for who in ("ours", "torch"):
        model = _model()
        trainable = [p for p in model.parameters() if p.requires_grad]
        cls = ZeroRedundancyOptimizer if who == "torch" else fns["ShardedOptimizer"]
        with _rules.exempt() if who == "torch" else contextlib.nullcontext():
            opt = cls(trainable, _fast("AdamW"), **OPTIMIZERS["adamw"][1])
            for step in range(STEPS):
                x, y = _batch(step)
                model(x, y)[1].backward()
                opt.step()
                opt.zero_grad()
        if who == "ours":
            _rules.scan_built(model, opt)
        out[who] = [p.detach().clone() for p in model.parameters()]
    return out


class ReferenceGradAccumulator:
    """ShardedGradAccumulator fixed: each micro-step's reduced shard adds into `shard`."""

    def __init__(self, numel: int, group=None):
        self.group, self.world = group, dist.get_world_size(group)
        self.chunk = -(-numel // self.world)
        self.shard = torch.zeros(self.chunk)

    @torch.no_grad()
    def reduce(self, flat_grad: torch.Tensor) -> None:
        padded = torch.zeros(self.chunk * self.world)
        padded[:flat_grad.numel()] = flat_grad
        out = torch.empty(self.chunk)
        dist.reduce_scatter_single(out, padded, group=self.group)
        self.shard += out.div_(self.world)

    def zero(self) -> None:
        self.shard.zero_()


ACC_NUMEL, ACC_MICRO = 11, 3  # 11 elements: padded on 2 ranks and on 3


def _accumulator_part(fns, r: int, n: int) -> dict:
    """Two optimizer steps of ACC_MICRO micro-steps each: this rank's shard before each
    step, and what it should hold (computed here from every rank's gradients)."""
    acc = fns["ShardedGradAccumulator"](ACC_NUMEL)
    out = {"got": [], "want": [], "last": []}
    chunk = -(-ACC_NUMEL // n)
    for step in range(2):
        grads = {(q, i): torch.randn(ACC_NUMEL, generator=torch.Generator().manual_seed(
                 1000 * step + 10 * q + i)) / ACC_MICRO for q in range(n) for i in range(ACC_MICRO)}
        for i in range(ACC_MICRO):
            acc.reduce(grads[r, i].clone())
        whole = torch.zeros(chunk * n)
        whole[:ACC_NUMEL] = sum(grads.values()) / n
        last = torch.zeros(chunk * n)
        last[:ACC_NUMEL] = sum(grads[q, ACC_MICRO - 1] for q in range(n)) / n
        out["got"].append(acc.shard.clone())
        out["want"].append(whole[r * chunk:(r + 1) * chunk])
        out["last"].append(last[r * chunk:(r + 1) * chunk])
        acc.zero()
    return out


class Scrambled(torch.nn.Module):
    """Registered a, b, c; forward uses c, then b, then a: backward completes a's gradient
    first and c's last. With one unit per parameter (cap 0: units in reverse registration
    order, c, b, a) the units complete in the order 2, 1, 0. Their sizes differ (12, 20,
    10 elements), so the order of the reduce-scatters shows in their sizes."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 2, bias=False)
        self.b = torch.nn.Linear(4, 5, bias=False)
        self.c = torch.nn.Linear(3, 4, bias=False)

    def forward(self, x):
        return self.a(torch.tanh(self.b(torch.tanh(self.c(x))))).square().mean()


def _order_part(fns, r: int, n: int) -> dict:
    """Stage 2, one unit per parameter, a model whose backward completes the units out of
    index order: the reduce-scatters in the order they were issued (their input sizes),
    the units' sizes in index order, and the order backward completed them."""
    H.skip_dynamo_import()
    torch.manual_seed(0)
    model = Scrambled()
    done = []
    names = {id(p): k for k, p in model.named_parameters()}
    for p in model.parameters():  # before the optimizer's hooks: ours fire first
        p.register_post_accumulate_grad_hook(lambda p: done.append(names[id(p)]))
    opt = fns["ShardedOptimizer"](list(model.parameters()), _fast("SGD"), stage=2, bucket_cap_mb=0,
                                  collectives="torch", lr=0.1)
    _rules.scan_built(model, opt)
    traffic = H.traffic()
    g = torch.Generator().manual_seed(7 + r)
    out = {"issued": [], "completed": []}
    for step in range(2):
        done.clear()
        with traffic.phase_of(("backward", step)):
            model(torch.randn(4, 3, generator=g)).backward()
        out["issued"].append([sum(t.numel() for t in e.data or []) for e in traffic.events
                              if e.kind in ("reduce_scatter", "all_reduce")
                              and e.phase == ("backward", step)])
        out["completed"].append(list(done))
        opt.step()
        opt.zero_grad()
    # the units' sizes in index order: reverse registration order, each padded to n
    out["units"] = [-(-p.numel() // n) * n for p in reversed(list(model.parameters()))]
    return out


PARTS = {"oracle": _oracle_part, "zero1": functools.partial(_train_part, "zero1"),
         "zero_redundancy": _zero_redundancy_part,
         **{k: functools.partial(_train_part, k)
            for k in SPECS if k != "zero1"},
         "order": _order_part}
# ZeroRedundancyOptimizer and the reduce order at 2 ranks; the oracle first, then ZeRO-1's
# parts, then ZeRO-2's (a part that crashes or hangs stops its launch: ZeRO-1's marks do
# not wait on ZeRO-2)
PLAN = {n: [p for p in PARTS if n == 2 or p not in ("zero_redundancy", "order")] for n in WORLD_SIZES}


class _NoOptimizer:
    """An inner optimizer that does nothing, for the preflight."""

    def __init__(self, params, **kwargs):
        self.param_groups, self.state = list(params), {}


def _preflight(cls) -> str | None:
    """The hint of a stub that raises NotImplementedError while being constructed, in
    this process, as rank 0 of 2 (no process group: construction needs none): then the
    launches, seconds of starting processes, would only bring back that same hint."""
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(3))]
    with mock.patch.object(dist, "get_rank", lambda group=None: 0), \
            mock.patch.object(dist, "get_world_size", lambda group=None: 2):
        try:
            cls([{"params": params[:1]}, {"params": params[1:]}], _NoOptimizer, bucket_cap_mb=CAP_MB)
        except NotImplementedError as e:
            return str(e)
        except Exception:  # anything else is for the ranks to show
            pass
    return None


_CACHE = H.Cache()


def _results(impl) -> dict:
    plan = {n: PLAN[n] for n in WORLD_SIZES}
    fns = {"ShardedOptimizer": impl.ShardedOptimizer,
           "ShardedGradAccumulator": impl.ShardedGradAccumulator}
    parts = {**PARTS, "accumulator": _accumulator_part}
    first = min(plan)  # the find-the-bug part runs at the first world size, with its launch

    def compute():
        hint = H.preflight(_preflight, impl.ShardedOptimizer)
        if hint is None:
            return H.run_all(parts, fns, {n: ps + ["accumulator"] * (n == first)
                                          for n, ps in plan.items()}, TIMEOUT_S, HANG_HINT, RULES)
        # a stub optimizer: its hint without a launch; the find-the-bug part is shipped
        # code, so it runs whatever the optimizer's state
        done = H.run_all(parts, fns, {first: ["accumulator"]}, TIMEOUT_S, HANG_HINT, RULES)
        return {**done, **{(p, n): ("notimpl", hint) for n, ps in plan.items() for p in ps}}
    key = (impl.ShardedOptimizer, impl.ShardedGradAccumulator, WORLD_SIZES, TIMEOUT_S)
    return _CACHE.get(key, compute)  # tests change the last two


def _part(impl, name, world_sizes=None):
    return H.per_world_size(_results(impl), name, world_sizes or WORLD_SIZES)


def _oracle(impl, n: int) -> dict:
    for _, per_rank in H.per_world_size(_results(impl), "oracle", (n,)):
        return per_rank[0]


# --------------------------------------------------------------------- comparing parameters

def _names() -> list[str]:
    return [k for k, _ in _model().named_parameters()]


def _close(got, want, rtol=1e-5, atol=1e-6) -> bool:
    # float32, the same arithmetic up to the order of the sums: equal up to rounding
    return got.shape == want.shape and bool(((got - want).abs() <= atol + rtol * want.abs()).all())


def _ranks_problem(where: str, per_rank_params: list) -> str | None:
    """None when every rank holds the same parameters (bit for bit), else which differ."""
    for r, params in enumerate(per_rank_params):
        for k, a, b in zip(_names(), params, per_rank_params[0]):
            if not torch.equal(a, b):
                return (f"{where}: after {STEPS} steps rank {r}'s {k} differs from rank 0's: every "
                        "rank must end a step with every parameter. After the inner optimizer's "
                        "step, all-gather each unit (u.shard from every rank into u.flat)")
    return None


def _param_problem(where: str, per_rank: list, oracle: dict, opt: str, n: int) -> str | None:
    """None when every rank's parameters after the steps are one process's, else what is
    wrong, with a guess at why."""
    names, want, initial = _names(), oracle[opt], oracle["initial"]
    problem = _ranks_problem(where, [res["params"] for res in per_rank])
    if problem:
        return problem
    got = per_rank[0]["params"]
    for k, g, w, i in zip(names, got, want, initial):
        if _close(g, w):
            continue
        at = f"{where}: after {STEPS} steps {k} differs from one process's on the whole batch"
        if k == "wpe.weight":
            return f"{at}: it is frozen (requires_grad=False) and must not change"
        if torch.equal(g, i):
            return (f"{at}: it never changed. Does the inner optimizer see the gradient shards "
                    "(v.grad = u.grad_shard[a:b] on each shard view), and is something written "
                    "into them before its step?")
        if n > 1 and _close(g, oracle[f"{opt} x{n}"][names.index(k)]):
            return (f"{at}: it took the steps of gradients {n} times too large: the "
                    "reduce-scatter must average over ranks (op=dist.ReduceOp.AVG, or "
                    "op='avg' with minidist.comm), not sum")
        j = int((g - w).abs().argmax())
        return (f"{at}: element {j} is {g.reshape(-1)[j].item():.6g}, want "
                f"{w.reshape(-1)[j].item():.6g}")
    return None


def _equivalence(impl, parts):
    for name in parts:
        for n, per_rank in _part(impl, name):
            where = f"on {n} ranks, {_describe(name)}"
            problem = _param_problem(where, per_rank, _oracle(impl, n), SPECS[name]["opt"], n)
            kept = SPECS[name]["stage"] == 2 and any(any(res["after_backward"]) for res in per_rank)
            if problem and kept and SPECS[name]["accum"] > 1:
                problem += (". And p.grad was still set after backward: the next micro-step's "
                            "gradient adds to it, and the old gradient is reduced a second time. "
                            "Free the full gradients (p.grad = None) once copied out")
            H.first_problem([problem] + [f"on {n} ranks, rank {r}, {_describe(name)}, {res['carried']}"
                                         if res.get("carried") else None for r, res in enumerate(per_rank)])


# --------------------------------------------------------------------- the checks

@check("06", points=3, name="ZeRO-1, gradients averaged beforehand (ZeroRedundancyOptimizer's "
                            "contract): 2 and 3 ranks == one process (AdamW, param groups)")
def _zero1(impl):
    _equivalence(impl, ["zero1"])
    lr = OPTIMIZERS["adamw"][1]["lr"]
    want = [g.get("lr", lr) / 2 for g in _groups(_model())]
    for n, per_rank in _part(impl, "zero1"):
        for r, res in enumerate(per_rank):
            assert res["lrs"] == want, (
                f"on {n} ranks, rank {r}: the learning rates of opt.param_groups are {res['lrs']}, "
                f"want {want}, one per param group passed in, in order (a group with no element "
                "on this rank too: give it a placeholder), so that a scheduler setting g['lr'] "
                "reaches the parameters it means")


@check("06", points=2, name="ZeRO-1 == torch's ZeroRedundancyOptimizer (2 ranks, AdamW)")
def _zero_redundancy(impl):
    for _, per_rank in _part(impl, "zero_redundancy", (2,)):
        H.first_problem([_ranks_problem("on 2 ranks, AdamW, a plain list of parameters",
                                        [res["ours"] for res in per_rank])])
        for r, res in enumerate(per_rank):
            for k, a, b in zip(_names(), res["ours"], res["torch"]):
                if not _close(a, b, rtol=1e-6, atol=1e-7):
                    j = int((a - b).abs().argmax())
                    raise AssertionError(
                        f"on 2 ranks, rank {r}: after {STEPS} AdamW steps (the whole batch on "
                        f"every rank, a plain list of parameters) {k} differs from "
                        f"ZeroRedundancyOptimizer's: element {j} is {a.reshape(-1)[j].item():.6g}, "
                        f"want {b.reshape(-1)[j].item():.6g}")


@check("06", points=2, name="optimizer state: AdamW's 8 bytes per element of this rank's shard "
                            "(padded/N elements), not of the whole model")
def _state_memory(impl):
    for n, per_rank in _part(impl, "zero1"):
        lay = _layout(n)
        per = lay["padded"] // n
        for r, res in enumerate(per_rank):
            got, lo, hi = res["state_bytes"], 8 * lay["owned"][r], 8 * per
            where = f"on {n} ranks, rank {r}, {_describe('zero1')}"
            assert res["inner"] >= 1, \
                f"{where}: optimizer_class was never called: build the inner optimizer with it"
            held = res["reachable_state"]
            if lo <= got <= hi and held <= hi + STATE_SLACK:
                continue
            if lo <= got <= hi:
                raise AssertionError(
                    f"{where}: tensors your optimizer can reach hold {held} bytes that are "
                    f"neither parameters nor gradients (the grader walks every reference from it, "
                    f"the model's parameters and their hooks, and your module's globals); the "
                    f"state of this rank's shard is at most 8 x padded/N = {hi} bytes. State kept "
                    "anywhere, not only in the inner optimizer's self.state, counts")
            whole = " (that of the whole model: build the inner optimizer on this rank's shard " \
                    "views only)" if got >= 8 * lay["psi"] else ""
            raise AssertionError(
                f"{where}: the inner optimizer's state (exp_avg and exp_avg_sq) holds {got} "
                f"bytes{whole}; want 8 bytes per element of this rank's shards: "
                f"8 x padded/N = 8 x {lay['padded']}/{n} = {hi} bytes (Psi = {lay['psi']} "
                f"trainable elements; the padding may go without state: at least {lo})")


@check("06", points=2, name="ZeRO-1, reduce_gradients=True (reduce-scatter after backward; "
                            "no_sync): == one process (AdamW, SGD, accumulation)")
def _zero1_reduce(impl):
    _equivalence(impl, ["zero1_reduce", "zero1_reduce_sgd"])


@check("06", points=3, name="ZeRO-2 (reduce-scatter of each unit during backward): == one "
                            "process (AdamW; SGD with accumulation)")
def _zero2(impl):
    _equivalence(impl, ["zero2", "zero2_accum"])


@check("06", points=2, name="ZeRO-2 gradient memory: full gradients freed during backward, "
                            "4 bytes x padded/N per rank after the step")
def _grad_memory(impl):
    for name in ("zero2", "zero2_accum"):
        for n, per_rank in _part(impl, name):
            lay = _layout(n)
            for r, res in enumerate(per_rank):
                where = f"on {n} ranks, rank {r}, {_describe(name)}"
                for i, kept in enumerate(res["after_backward"]):
                    assert not kept, (
                        f"{where}: when backward {i + 1} returned, p.grad was still set for "
                        f"{len(kept)} parameter(s) ({', '.join(kept[:3])}"
                        f"{', ...' if len(kept) > 3 else ''}): "
                        "ZeRO-2 keeps only the gradient shard; set p.grad = None once the unit's "
                        "gradients are copied out for the reduce-scatter")
                for i, held in enumerate(res["held_after_backward"]):
                    assert held <= 4 * lay["padded"] // n + STATE_SLACK, (
                        f"{where}: when backward {i + 1} returned, tensors your optimizer can reach "
                        f"held {held} bytes of gradients (the grader walks every reference from it, "
                        "the model's parameters and their hooks, and your module's globals, and "
                        "counts what holds neither parameters nor optimizer state); ZeRO-2 keeps "
                        f"only the gradient shards, 4 x padded/N = {4 * lay['padded'] // n} bytes: "
                        "no full-size gradient, nor a copy of one, once its unit is reduced")
                limit = lay["psi"] // 2
                assert res["peak"] <= limit, (
                    f"{where}: at one moment of backward {res['peak']} of the {lay['psi']} "
                    "gradient elements were alive as full-size p.grad: free each unit's "
                    "gradients (p.grad = None) when its reduce-scatter starts, as soon as its "
                    "last gradient is complete, not at the end of backward (want at most half, "
                    f"{limit})")
                got, lo, hi = res["grad_bytes"], 4 * lay["owned"][r], 4 * lay["padded"] // n
                if not lo <= got <= hi:
                    raise AssertionError(
                        f"{where}: after the step this rank's gradients take {got} bytes; want "
                        f"4 bytes per element of its shards: 4 x padded/N = 4 x {lay['padded']}/{n} "
                        f"= {hi} (the averaged gradient shards; no full-size gradient, averaged "
                        "or not, kept anywhere the optimizer sees)")


@check("06", points=2, name="bytes on the wire (collectives='minidist'): per step one reduce-scatter "
                            "and one all-gather of padded (N-1)/N elements each, 2 Psi (N-1)/N")
def _bytes(impl):
    for name in ("zero1_reduce_sgd", "zero2"):
        for n, per_rank in _part(impl, name):
            lay = _layout(n)
            each = STEPS * 4 * lay["padded"] * (n - 1) // n
            want = {"reduce_scatter": each, "all_gather": each}
            for r, res in enumerate(per_rank):
                got = {k: v for k, v in res["sent"].items() if v}
                if got == want:
                    continue
                where = f"on {n} ranks, rank {r}, {_describe(name)}, {STEPS} steps"
                hint = ""
                if any("torch.distributed" in k for k in got):
                    hint = (": torch.distributed's collectives were called. With "
                            "collectives='minidist' call comm.reduce_scatter and comm.all_gather "
                            "(the ring of chapter 02, point-to-point messages)")
                elif not got:
                    hint = (": nothing went through minidist.comm. With collectives='minidist' "
                            "call comm.reduce_scatter and comm.all_gather")
                elif got.get("inside no_sync"):
                    hint = (": messages went out while backward ran inside no_sync(). Inside "
                            "no_sync() stage 1 reduces nothing: the last micro-step reduces the "
                            "accumulated gradients once")
                elif got.get("reduce_scatter", 0) >= 2 * each:
                    hint = (": an all-reduce moves twice a reduce-scatter's bytes and leaves every "
                            "rank the whole gradient. Reduce-scatter: each rank receives only "
                            "its shard, averaged")
                elif not got.get("all_gather"):
                    hint = (": no all-gather. After the inner optimizer's step every rank must "
                            "all-gather each unit, or the others' updates never reach it")
                elif got.get("reduce_scatter", 0) > each:
                    hint = (": more than one reduce-scatter per unit per step. Inside no_sync() "
                            "stage 1 reduces nothing: the last micro-step reduces the "
                            "accumulated gradients once")
                raise AssertionError(
                    f"{where}: sent {got} bytes (every message recorded below torch.distributed's "
                    "Python, exercises/_traffic.py: while backward ran, the reduce-scatters'; in "
                    f"step, the all-gathers'); want {want}: each collective moves "
                    f"4 x padded x (N-1)/N = 4 x {lay['padded']} x {n - 1}/{n} bytes per "
                    f"step{hint}")


@check("06", points=2, name="reduce order: units reduce-scattered in unit index order on every rank, "
                            "even when backward completes them in another order")
def _reduce_order(impl):
    for n, per_rank in _part(impl, "order", (2,)):
        for r, res in enumerate(per_rank):
            for step, (got, completed) in enumerate(zip(res["issued"], res["completed"])):
                want = res["units"]
                where = (f"on {n} ranks, rank {r}, backward {step + 1}: stage 2, one unit per parameter "
                         f"(sizes {want} in index order), a model whose backward completes them in "
                         f"another order ({', '.join(completed)})")
                assert got == want, (
                    f"{where}: reduce-scatters of {got} elements, in that order; want one per unit, in "
                    f"unit index order, {want}. Ranks pair collectives by the order they are issued "
                    "(chapter 03, section 4): if another rank's backward completes its units in "
                    "another order (autograd promises none), its reduce-scatter of unit 0 meets this "
                    "rank's of unit 2. Start unit k only once units 0..k-1 have started: a complete "
                    "unit waits for the ones before it")


@check("06", points=2, name="find the bug: ShardedGradAccumulator keeps every micro-step's gradient")
def _accumulator(impl):
    n = min(WORLD_SIZES)
    for _, per_rank in _part(impl, "accumulator", (n,)):
        for r, res in enumerate(per_rank):
            for step, (got, want, last) in enumerate(zip(res["got"], res["want"], res["last"])):
                if _close(got, want):
                    continue
                where = (f"{n} ranks, {ACC_MICRO} micro-steps, optimizer step {step}: rank {r}'s "
                         "shard")
                if _close(got, last):
                    raise AssertionError(
                        f"{where} holds only the last micro-step's gradient: each micro-step's "
                        "reduce-scatter must ADD into the shard (the full gradients were freed; "
                        "the shard is the only place they accumulate), and zero() empties it")
                if _close(got, n * want):
                    raise AssertionError(f"{where} is {n} times too large: average over ranks")
                raise AssertionError(f"{where} is not its slice of the whole batch's gradient "
                                     "averaged over ranks")


# Tiered hints, shown one at a time by `python -m exercises.grade 06 --hint`: first what to
# look at, then one method at a time, in the order the grader's parts call them.
HINTS = {
    "_zero1": [
        "Part 1 first. The inner optimizer must only ever see this rank's shard: its param "
        "groups are views into u.shard (one per unit that holds elements of the group), and "
        "each view's .grad is the matching view of u.grad_shard, set once in __init__: the "
        "inner optimizer then reads the averaged gradient shard wherever you write it. One "
        "inner optimizer, optimizer_class(shard_groups, **defaults), each shard group with "
        "its group's own settings (weight_decay, lr, ...).",
        "_shard_param_groups: u.ranges says where each group's elements lie in a unit's "
        "shard. A group with no element on this rank still needs its entry (a placeholder of "
        "no elements, with a .grad of its own), so that param_groups[i] stays the i-th group "
        "passed in on every rank.",
        "_take_local_gradients: under ZeroRedundancyOptimizer's contract p.grad is averaged "
        "already; this rank's slice of each unit's flat local gradients (u.flat_grads()) "
        "goes into its gradient shard.",
        "step: the closure, if any; the local gradients when this optimizer does not reduce "
        "them itself; the inner optimizer's step; then every unit's all-gather (its shard "
        "from every rank into its flat buffer), all started in unit order, then all waited "
        "for. zero_grad empties the gradient shards in place (the inner optimizer's .grad "
        "are views of them) and drops the full-size gradients.",
        "_all_gather: with 'minidist', minidist.comm's ring (synchronous: nothing left to wait "
        "for); mind that the input is a view into the output. With 'torch', "
        "torch.distributed's all-gather into one tensor, asynchronous, on self.group, and its "
        "work returned.",
    ],
    "_zero_redundancy": [
        "ZeroRedundancyOptimizer's contract: p.grad is already averaged when step() runs; "
        "step copies this rank's slice of it into the shards, steps, and all-gathers. If "
        "the ZeRO-1 check passes and this one fails, compare your step with the contract.",
    ],
    "_state_memory": [
        "The inner optimizer's state follows its parameters: build it on views of the "
        "shards only (u.shard[a:b]), never on the model's parameters, or AdamW keeps its "
        "moments for the whole model on every rank.",
    ],
    "_zero1_reduce": [
        "Part 2. Reducing a unit: its full local gradients flattened (u.flat_grads()), freed "
        "(p.grad = None), and a reduce-scatter that AVERAGES into a new tensor shaped like "
        "u.grad_shard; the results are added (+=) into u.grad_shard at the end of backward.",
        "A post-accumulate-grad hook on every trainable parameter (registered for you: "
        "_on_grad) counts completed gradients. Stage 1 reduces every unit after backward, "
        "from a callback queued by the first hook of each backward; inside no_sync() it "
        "reduces nothing and lets p.grad accumulate. When backward ends: reduce the units "
        "not reduced yet, in unit index order, wait for every reduce-scatter, add each "
        "result into u.grad_shard, reset for the next backward.",
        "_reduce_scatter: with 'minidist', minidist.comm's reduce-scatter, averaging "
        "(synchronous); with 'torch', torch.distributed's reduce-scatter into one tensor, "
        "averaging, asynchronous, on self.group, and its work returned.",
        "The order: ranks pair collectives by the order they are issued, so the units are "
        "reduced in unit index order on every rank. Keep the index of the next unit to "
        "reduce; at stage 2, after each hook, reduce units from there while they are "
        "complete; at the end of backward reduce the rest, in order, complete or not (a "
        "parameter without a gradient still joins). Inside no_sync() at stage 1 the hook "
        "does nothing at all.",
    ],
    "_zero2": [
        "Stage 2 reduces a unit from the hook, during backward, as soon as its gradients are "
        "complete and every unit before it has been started (unit index order); at the end "
        "of backward, reduce every unit not started yet, in order. Inside no_sync() stage 2 "
        "reduces anyway: it keeps no full gradient to accumulate into.",
        "With accumulation stage 2 reduces every micro-step: each reduce-scatter's result "
        "must ADD into u.grad_shard (+=), or only the last micro-batch's gradient is left; "
        "zero_grad is what empties it.",
    ],
    "_reduce_order": [
        "Chapter 03, section 4: a hook never launches bucket k before buckets 0..k-1, "
        "because ranks pair collectives by the order they are issued and autograd promises "
        "no order of the gradients. The same holds for ZeRO's units.",
        "Keep the index of the next unit to start. After each hook, start units from there "
        "while they are complete, moving the index on; a complete unit further on waits. At "
        "the end of backward start the rest, in order.",
    ],
    "_grad_memory": [
        "Free the full-size gradients as soon as a unit is reduced (p.grad = None for its "
        "parameters); after step only the shards, 4 bytes x padded/N per rank, remain.",
    ],
    "_accumulator": [
        "Follow one rank's shard through three micro-steps: what does it hold after the "
        "second reduce(), and where did the first micro-step's gradient go?",
        "The reduce-scatter of each micro-step must be added into the shard (+=), not "
        "copied over it: under ZeRO-2 the full-size gradients are freed after each "
        "micro-step, so the shard is the only place they add up.",
    ],
    "_bytes": [
        "collectives='minidist' must send everything through minidist.comm's reduce_scatter "
        "and all_gather (the ring, which counts its bytes): one reduce-scatter and one "
        "all-gather per unit per step, nothing else.",
    ],
}
