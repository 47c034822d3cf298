"""Graded checks of exercise 03 (exercises/03_data_parallel.py), registered with exercises.grade.

make_buckets is checked here, in one process, against the bucketing rule written out
below. BucketedDDP runs where it must: in 2 and 3 processes started by
minidist.launch.launch (gloo), one launch per world size for every part (see
exercises/_harness.py). Its oracle is one process training the same model on the whole
batch, computed on every rank alongside, step by step. While the wrapper runs, the grader
records from the outside what it does: every all-reduce (seen by the part's recorder below
torch.distributed's Python, exercises/_traffic.py, where every road to gloo meets: its size,
whether it is asynchronous, and a copy of its buffer as it started, which must hold the
bucket's gradients) and every gradient's completion (a post-accumulate-grad hook
registered before the wrapper's own, so it fires first). Data moved any other way (a
process group of the learner's own, the store, a backend object) scores the part 0.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from exercises import _harness as H
from exercises import _rules
from exercises.grade import check
from minidist.ddp import make_buckets

WORLD_SIZES = (2, 3)
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
STEPS, BATCH, SEQ = 3, 12, 6  # BATCH divides over 2 and 3 ranks
CAPS = {"several": 0.004, "one_bucket": None, "per_param": 0}  # 0.004 MiB: 5 buckets below
HANG_HINT = ("Every rank must launch the same all-reduces in the same order and wait only "
             "for what it launched.")
# The exercise's rules, watched in every part while the learner's code runs
# (exercises/_rules.py); the grader's own collectives run in _rules.exempt().
_NOT_TORCH = "build the buckets, hooks and all-reduces yourself, not with torch's wrappers"
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.ddp", "minidist.train", "minidist.compose.build", "minidist.train_gpt")
RULES = _rules.Rules(
    allowed=("allreduce", "broadcast", "send", "recv"),
    collective_rule="exercise 03 moves data with dist.broadcast (construction) and "
                    "dist.all_reduce (the buckets) only",
    apis={_rules.TORCH_DDP: _NOT_TORCH, **{name: _NOT_TORCH for name in _rules.TORCH_FSDP}})


# --------------------------------------------------------------------- reference adapter

def reference_make_buckets(module: nn.Module, bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """minidist.ddp.make_buckets with the exercise's signature (minidist's takes the
    parameters already in the order backward produces their gradients)."""
    return make_buckets([p for p in reversed(list(module.parameters())) if p.requires_grad],
                        bucket_cap_mb)


def reference_bucket_by_dtype(module: nn.Module, bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """bucket_by_dtype fixed: the parameters in a list (reverse registration order), not a
    set, whose order follows the objects' addresses: different on every rank and run."""
    order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
    by_dtype: dict = {}
    for p in order:
        by_dtype.setdefault(p.dtype, []).append(p)
    return [b for params in by_dtype.values() for b in make_buckets(params, bucket_cap_mb)]


# --------------------------------------------------------------------- model, data, oracles

class Net(nn.Module):
    """An embedding tied to the head (one parameter used twice, complete only at the end
    of backward), a frozen layer (no gradient, in no bucket), a buffer (broadcast too),
    and tensors of different sizes for several buckets."""

    def __init__(self, V: int = 50, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("gain", 0.5 + torch.rand(d))

    def forward(self, x, y):
        h = self.body(self.frozen(self.emb(x)) * self.gain)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def expected_buckets(module: nn.Module, cap_mb: float | None) -> list[list[nn.Parameter]]:
    """The rule the exercise states, written out: trainable parameters, each once, in
    reverse registration order, a new bucket when the next would go over the cap."""
    cap = float("inf") if cap_mb is None else cap_mb * 2 ** 20
    buckets, used = [], 0
    for p in reversed([p for p in module.parameters() if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if not buckets or used + nbytes > cap:
            buckets.append([])
            used = 0
        buckets[-1].append(p)
        used += nbytes
    return buckets


class Scrambled(nn.Module):
    """Registered a, b, c; forward uses c, then b, then a, so backward completes a's
    gradient first and c's last: with one bucket per parameter (reverse registration:
    c, b, a) the buckets fill in the order 2, 1, 0. Their sizes differ (12, 20, 10
    elements), so the order of the all-reduces shows in their sizes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 2, bias=False)
        self.b = nn.Linear(4, 5, bias=False)
        self.c = nn.Linear(3, 4, bias=False)

    def forward(self, x, y):
        return F.mse_loss(self.a(torch.tanh(self.b(torch.tanh(self.c(x))))), y)


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 50, (BATCH, SEQ), generator=g)
    return x, torch.randint(0, 50, (BATCH, SEQ), generator=g)


def _close(got: torch.Tensor, want: torch.Tensor, rtol=1e-5, atol=1e-6) -> bool:
    # float32, the same arithmetic up to the order of the sums: equal up to rounding
    return bool(((got - want).abs() <= atol + rtol * want.abs()).all())


def _grad_problem(step, names, got, want, local, n) -> str | None:
    """None when every gradient is the full batch's, else what is wrong, with a guess."""
    for name in names:
        g, w = got[name], want[name]
        if g is None:
            return (f"step {step}: {name}.grad is None when loss.backward() returns; the "
                    "averaged gradient belongs in p.grad")
        if _close(g, w):
            continue
        where = f"step {step}: {name}.grad differs from one process's on the whole batch"
        if _close(g, n * w):
            return f"{where}: it is {n} times too large (all-reduce sums: divide by the world size)"
        if _close(g, local[name]):
            return (f"{where}: it is still this rank's own gradient when loss.backward() "
                    "returns (wait for the all-reduces at the end of backward and copy the "
                    "averaged buffers back into p.grad)")
        i = int((g - w).abs().argmax())
        return (f"{where}: element {i} is {g.reshape(-1)[i].item():.6g}, want "
                f"{w.reshape(-1)[i].item():.6g}")
    return None


@torch.no_grad()
def _sgd_step(model: nn.Module, momentum: dict, lr: float = 0.1, beta: float = 0.9) -> None:
    """SGD with momentum (torch.optim.SGD's arithmetic), then zero_grad(set_to_none=True).
    Written out: torch.optim's first step imports torch._dynamo, seconds per process."""
    for p in model.parameters():
        if p.grad is not None:
            b = momentum.get(p)
            momentum[p] = b = p.grad.clone() if b is None else b.mul_(beta).add_(p.grad)
            p.sub_(lr * b)
            p.grad = None


# --------------------------------------------------------------------- recording

class _Recorder:
    """Events of one backward, in order: ("grad", name) when a gradient is complete,
    ("all_reduce", numel, async) when an all-reduce starts (seen by the part's recorder,
    below torch.distributed's Python: exercises/_traffic.py), and what each all-reduce
    carried (a copy of its buffer as it started)."""

    def __init__(self):
        self.events, self.carried, self.on = [], [], False

    def hook(self, name):
        def record(p):
            if self.on:
                self.events.append(("grad", name))
        return record

    def _seen(self, e):
        if self.on and e.kind == "all_reduce":
            self.events.append(("all_reduce", sum(t.numel() for t in e.outputs), bool(e.async_)))
            self.carried.append(torch.cat([t.reshape(-1) for t in e.data]) if e.data else None)

    def __enter__(self):
        H.traffic().listeners.append(self._seen)
        return self

    def __exit__(self, *exc):
        H.traffic().listeners.remove(self._seen)


def _not_carried(step: int, carried: list, buckets: list, local: dict, n: int) -> str | None:
    """None when the all-reduces of a backward carried, between them, every bucket's
    gradients: each one's buffer holds one bucket's local gradients (in any order within
    it), as they were or divided by the world size; else what is wrong. Gradients that
    reached p.grad another way than the recorded all-reduces show here."""
    every = torch.cat([local[name].reshape(-1) for b in buckets for name in b]).double().sort().values
    sent = [c for c in carried if c is not None]
    if sent and sum(c.numel() for c in sent) == every.numel():  # however they were cut
        got = torch.cat(sent).double().sort().values
        if any(_close(got, every * s, rtol=1e-4, atol=1e-6) for s in (1.0, 1.0 / n)):
            return None
    want = [torch.cat([local[name].reshape(-1) for name in b]).sort().values for b in buckets]
    matched = set()
    for j, got in enumerate(carried):
        if got is None:
            continue
        got = got.double().sort().values
        for k, w in enumerate(want):
            if k not in matched and got.numel() == w.numel() and any(
                    _close(got, w.double() * s, rtol=1e-4, atol=1e-6) for s in (1.0, 1.0 / n)):
                matched.add(k)
                break
    missing = [k for k in range(len(buckets)) if k not in matched]
    if not missing:
        return None
    k = missing[0]
    return (f"step {step}: no all-reduce of this backward carried bucket {k}'s gradients "
            f"({', '.join(buckets[k][:3])}{', ...' if len(buckets[k]) > 3 else ''}): the grader "
            "records every all-reduce with what its buffer held when it started, and each "
            "bucket's must hold its parameters' gradients (this rank's own, or divided by the "
            "world size). Gradients that reach p.grad any other way do not count")


# --------------------------------------------------------------------- the parts, run on every rank

def _broadcast_part(fns: dict, r: int, n: int) -> str | None:
    torch.manual_seed(100 + r)  # every rank starts different
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = fns["BucketedDDP"](model, bucket_cap_mb=CAPS["several"])
    _rules.scan_built(ddp, model)
    for k, v in model.state_dict().items():
        everyone = [torch.empty_like(v) for _ in range(n)]
        with _rules.exempt():  # the grader's look at every rank, not the learner's code
            dist.all_gather(everyone, v.contiguous())
        what = "buffer" if k == "gain" else "parameter"
        if not torch.equal(everyone[r], everyone[0]):
            return (f"after construction rank {r}'s {what} {k} differs from rank 0's: "
                    f"broadcast every parameter and buffer from rank 0")
        if r == 0 and not torch.equal(v, before[k]):
            return f"construction changed rank 0's {what} {k}: rank 0's values are the ones to copy"
    return None


def _train_part(cap, fns: dict, r: int, n: int) -> dict:
    torch.manual_seed(0)
    oracle = Net()  # one process, the whole batch
    torch.manual_seed(0 if r == 0 else 100 + r)
    model = Net()  # rank 0's equals the oracle's; the wrapper must copy it everywhere
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    rec = _Recorder()
    for k, p in model.named_parameters():
        if p.requires_grad:  # before the wrapper's hooks: ours fire first
            p.register_post_accumulate_grad_hook(rec.hook(k))
    ddp = fns["BucketedDDP"](model, bucket_cap_mb=cap)
    _rules.scan_built(ddp, model)
    want_buckets = [sum(p.numel() for p in b) for b in expected_buckets(model, cap)]
    label = {id(p): k for k, p in model.named_parameters()}
    bucket_names = [[label[id(p)] for p in b] for b in expected_buckets(model, cap)]
    momenta = ({}, {})  # (oracle's, model's)
    per = BATCH // n
    out = {"problem": None, "steps": [], "buckets": want_buckets}
    for step in range(STEPS):
        x, y = _batch(step)
        xs, ys = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        # this rank's own gradient at the oracle's weights: what an unsynchronised p.grad holds
        oracle(xs, ys).backward()
        local = {k: p.grad.clone() for k, p in oracle.named_parameters() if p.requires_grad}
        oracle.zero_grad(set_to_none=True)
        oracle(x, y).backward()
        want = {k: p.grad for k, p in oracle.named_parameters() if p.requires_grad}
        with rec:
            rec.events, rec.carried, rec.on = [], [], True
            try:
                ddp(xs, ys).backward()
            finally:
                rec.on = False
        out["steps"].append(rec.events)
        got = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
        carried = _not_carried(step, rec.carried, bucket_names, local, n) if n > 1 else None
        out["carried"] = out.get("carried") or carried
        problem = _grad_problem(step, names, got, want, local, n) or carried
        if problem is not None:
            out["problem"] = problem
            return out
        for m, buf in zip((oracle, model), momenta):
            _sgd_step(m, buf)
    theirs = dict(model.named_parameters())
    for k, p in oracle.named_parameters():
        if not _close(theirs[k].detach(), p.detach()):
            out["problem"] = (f"after {STEPS} SGD steps parameter {k} differs from one "
                              "process's on the whole batch, though every gradient matched")
            break
    return out


def _order_part(fns: dict, r: int, n: int) -> dict:
    """The all-reduces of two backwards of Scrambled, one bucket per parameter, and the
    order in which backward filled the buckets."""
    torch.manual_seed(0)
    model = Scrambled()
    rec = _Recorder()
    for k, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(rec.hook(k))
    ddp = fns["BucketedDDP"](model, bucket_cap_mb=0)
    _rules.scan_built(ddp, model)
    buckets = expected_buckets(model, 0)
    index = {name: i for i, b in enumerate(buckets) for name, p in model.named_parameters()
             if any(p is q for q in b)}
    out = {"buckets": [sum(p.numel() for p in b) for b in buckets], "steps": [], "filled": []}
    g = torch.Generator().manual_seed(7 + r)
    for _ in range(2):
        x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
        with rec:
            rec.events, rec.carried, rec.on = [], [], True
            try:
                ddp(x, y).backward()
            finally:
                rec.on = False
        out["steps"].append([e[1] for e in rec.events if e[0] == "all_reduce"])
        out["filled"].append([index[e[1]] for e in rec.events if e[0] == "grad"])
        model.zero_grad(set_to_none=True)
    return out


PARTS = {"broadcast": _broadcast_part,
         **{name: functools.partial(_train_part, cap) for name, cap in CAPS.items()},
         "order": _order_part}

_CACHE = H.Cache()


def _results(impl) -> dict:
    fns = {"BucketedDDP": impl.BucketedDDP}
    key = (impl.BucketedDDP, WORLD_SIZES, TIMEOUT_S)  # tests change the last two
    # the launch-order part runs at the first world size only: the order is per rank
    plan = {n: [p for p in PARTS if p != "order" or n == WORLD_SIZES[0]] for n in WORLD_SIZES}
    return _CACHE.get(key, lambda: H.run_all(PARTS, fns, plan, TIMEOUT_S, HANG_HINT, RULES))


def _part(impl, name, world_sizes=None):
    return H.per_world_size(_results(impl), name, world_sizes or WORLD_SIZES)


# --------------------------------------------------------------------- the checks

def _names(module):
    return {id(p): n for n, p in module.named_parameters()}


@check("03", points=2, name="make_buckets: trainable, each once, reversed, filled up to the cap")
def _make_buckets(impl):
    torch.manual_seed(0)
    from minidist.model import GPT, GPTConfig
    gpt = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    gpt.wpe.requires_grad_(False)
    for model, caps in [(Net(), (None, 0, 0.004, 0.005, 4288 / 2**20)), (gpt, (None, 0, 0.01))]:
        label = _names(model)
        for cap in caps:
            got = impl.make_buckets(model, cap)
            show = lambda bs: [[label.get(id(p), "?") for p in b] for b in bs]  # noqa: E731
            want = show(expected_buckets(model, cap))
            assert isinstance(got, (list, tuple)) and all(isinstance(b, (list, tuple)) for b in got), \
                f"make_buckets(cap={cap}) got {type(got).__name__}, want a list of lists of parameters"
            assert show(got) == want, (
                f"{type(model).__name__}, bucket_cap_mb={cap}: got buckets {show(got)}, want "
                f"{want} (trainable parameters, each once, in reverse registration order, "
                "a new bucket when the next would go over the cap)")


@check("03", points=1, name="construction copies rank 0's parameters and buffers to every rank")
def _construction(impl):
    for _, per_rank in _part(impl, "broadcast"):
        H.first_problem(per_rank)


@check("03", points=3, name="2 and 3 ranks, several buckets: SGD steps == one process on the whole batch")
def _several(impl):
    for _, per_rank in _part(impl, "several"):
        H.first_problem(res["problem"] for res in per_rank)


@check("03", points=1, name="one bucket (cap None) and one per parameter (cap 0) == one process")
def _extremes(impl):
    for name in ("one_bucket", "per_param"):
        for _, per_rank in _part(impl, name, (2,)):
            H.first_problem(f"bucket_cap_mb={CAPS[name]}: {res['problem']}" if res["problem"] else None
                            for res in per_rank)


@check("03", points=2, name="overlap: an async all_reduce starts before backward's last gradient")
def _overlap(impl):
    for n, per_rank in _part(impl, "several"):
        for r, res in enumerate(per_rank):
            for step, events in enumerate(res["steps"]):
                grads = [i for i, e in enumerate(events) if e[0] == "grad"]
                if not grads:
                    raise AssertionError(f"on {n} ranks, step {step}: no gradient was produced")
                last = grads[-1]
                early = [e for e in events[:last] if e[0] == "all_reduce"]
                where = f"on {n} ranks, rank {r}, step {step}"
                total = sum(e[0] == "all_reduce" for e in events)
                assert early, (
                    f"{where}: all {total} all_reduce calls started after the last gradient "
                    f"({events[last][1]}) was complete: none overlapped backward. Launch a "
                    "bucket's all-reduce from the hook that fills it, not at the end")
                assert any(e[2] for e in early), (
                    f"{where}: the {len(early)} all_reduce calls during backward were "
                    "synchronous (async_op=False): each stops backward until its bucket is "
                    "summed. Pass async_op=True and wait() on the works at the end of backward")


@check("03", points=1, name="one all_reduce per bucket per backward, of its flat buffer, in bucket order")
def _one_per_bucket(impl):
    for name in CAPS:
        for n, per_rank in _part(impl, name, WORLD_SIZES if name == "several" else (2,)):
            for r, res in enumerate(per_rank):
                want = res["buckets"]
                if res.get("carried"):
                    raise AssertionError(f"bucket_cap_mb={CAPS[name]}, on {n} ranks, rank {r}, "
                                         + res["carried"])
                for step, events in enumerate(res["steps"]):
                    got = [e[1] for e in events if e[0] == "all_reduce"]
                    where = f"bucket_cap_mb={CAPS[name]}, on {n} ranks, rank {r}, step {step}"
                    assert len(got) == len(want), (
                        f"{where}: {len(got)} all_reduce calls in one backward; the cap makes "
                        f"{len(want)} bucket(s) of {want} elements: one all-reduce per bucket, "
                        "of its flat buffer")
                    assert got == want, (
                        f"{where}: all-reduced {got} elements, in that order; the buckets, in "
                        f"index order, hold {want}: launch bucket k only after buckets 0..k-1")


@check("03", points=2, name="launch order: bucket index order, even when backward fills them out of order")
def _launch_order(impl):
    for n, per_rank in _part(impl, "order", WORLD_SIZES[:1]):
        for r, res in enumerate(per_rank):
            want = res["buckets"]
            for step, (got, filled) in enumerate(zip(res["steps"], res["filled"])):
                as_filled = [want[i] for i in dict.fromkeys(filled)]
                where = (f"a model whose forward uses its layers in another order than it "
                         f"registers them, one bucket per parameter, on {n} ranks, rank {r}, "
                         f"step {step}")
                assert got != as_filled or got == want, (
                    f"{where}: all_reduce calls of {got} elements, in the order backward "
                    f"filled the buckets ({filled}); launch them in index order, {want}. Ranks pair "
                    "collectives by the order they are issued: if another rank's gradients "
                    "arrive in another order (autograd promises no order; a forward may "
                    "branch on the data), its all-reduce of bucket 0 meets this rank's of "
                    "bucket 2: different sizes abort the job, equal sizes silently sum "
                    "different parameters")
                assert got == want, (
                    f"{where}: all_reduce calls of {got} elements, in that order; the buckets, "
                    f"in index order, hold {want}: one all-reduce per bucket, in index order")


class MixedNet(nn.Module):
    """Layers in float32 and bfloat16 (one flat buffer holds one dtype), a frozen one."""

    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(6, 6)
        self.l1 = nn.Linear(6, 8).to(torch.bfloat16)
        self.l2 = nn.Linear(8, 8)
        self.l2.weight.requires_grad_(False)
        self.l3 = nn.Linear(8, 4).to(torch.bfloat16)
        self.l4 = nn.Linear(4, 4)


def _expected_by_dtype(module, cap_mb):
    order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
    out = []
    for dtype in dict.fromkeys(p.dtype for p in order):
        # expected_buckets' rule on this dtype's parameters alone
        only = nn.Module()
        only.params = nn.ParameterList([p for p in reversed(order) if p.dtype == dtype])
        out += expected_buckets(only, cap_mb)
    return out


@check("03", points=2, name="find the bug: bucket_by_dtype gives the same buckets on every rank, every run")
def _bucket_by_dtype(impl):
    # Each build makes new parameter objects at new addresses, as each rank and each run
    # does: buckets that depend on addresses differ from one build to the next.
    for build in range(6):
        model = MixedNet()
        label = _names(model)
        for cap in (None, 0, 200 / 2 ** 20):
            got = impl.bucket_by_dtype(model, cap)
            show = lambda bs: [[label.get(id(p), "?") for p in b] for b in bs]  # noqa: E731
            want = show(_expected_by_dtype(model, cap))
            assert show(got) == want, (
                f"build {build} of the model, bucket_cap_mb={cap}: got buckets {show(got)}, "
                f"want {want} (per dtype in order of first appearance, in reverse "
                "registration order). Buckets that change from one build of the same model "
                "to the next change from one rank to the next too: ranks would pair "
                "different buckets")


HINTS = {
    "_make_buckets": [
        "module.parameters() yields each parameter once (a tied weight too), in "
        "registration order: reverse it and keep those with requires_grad.",
        "Keep a running byte count of the current bucket (p.numel() * p.element_size()); "
        "start a new bucket when count + the next parameter's bytes > bucket_cap_mb * 2**20 "
        "(None: float('inf')) and the current bucket is not empty.",
    ],
    "_construction": [
        "In __init__, before anything else, every rank must end with rank 0's values of "
        "every parameter and every buffer (the grader's model has one): which collective "
        "copies one rank's tensor to all the others? Write into the tensors without "
        "autograd recording it.",
    ],
    "_several": [
        "State to keep: the buckets; per bucket one flat buffer, with a view of it for each "
        "of its parameters; where each parameter sits (its bucket, its position); which "
        "parameters are ready in this backward; each bucket's work (none until launched); "
        "the next bucket to launch; whether this backward's end-of-backward callback is "
        "queued.",
        "The hook runs once p.grad is complete: copy it into its view (autograd has no "
        "business recording that), mark it ready, and launch what is full and next in line. "
        "The first hook of a backward queues the end-of-backward callback on autograd's "
        "engine (chapter 03, section 4 shows the call).",
        "At the end of backward: launch what is left, in order; wait for every bucket; an "
        "all-reduce sums, and the average is wanted; put each view's values into its "
        "parameter's .grad; then reset what belongs to one backward.",
    ],
    "_extremes": [
        "bucket_cap_mb=None is one bucket of everything; 0 is one bucket per parameter. "
        "If only these fail, look at how your buckets are cut and how the last bucket is "
        "launched at the end of backward.",
    ],
    "_overlap": [
        "Launch a bucket's all-reduce from the hook that completes it, not at the end of "
        "backward: work = dist.all_reduce(buffer, async_op=True) returns at once.",
        "async_op=True, then wait() on every work in _end_of_backward: a synchronous "
        "all-reduce in a hook stops backward until the bucket is summed.",
    ],
    "_one_per_bucket": [
        "One all-reduce per bucket per backward, of the bucket's flat buffer (not one per "
        "parameter, not the whole model at the end), holding the bucket's gradients when it "
        "starts: the grader reads what each all-reduce carried.",
    ],
    "_launch_order": [
        "Gradients may complete in another order than the buckets assume. Keep the index "
        "of the next bucket to launch, and after each hook launch buckets only while the "
        "next one in line is full.",
        "After each hook, launch buckets only while the one next in line is full, moving "
        "the line on each time: a full bucket further on waits for the ones before it.",
    ],
    "_bucket_by_dtype": [
        "Run it twice on two fresh copies of the same model and compare: does anything in "
        "it depend on where the parameters live in memory?",
        "A Python set of objects without their own hash iterates in the order of their "
        "addresses, different on every rank and run. Where does bucket_by_dtype iterate one, "
        "and what order does the docstring ask for instead?",
    ],
}
