"""Graded checks of exercise 03: make_buckets and bucket_by_dtype against the bucketing rule written
out here, BucketedDDP (2 and 3 ranks) against one process training the same model on the whole batch.
The grader's post-accumulate-grad hooks (registered first, so they fire first) mark in events() where
each gradient was complete, a wrapper of Work.wait where the code waited: overlap is read from the order.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from exercises.grader import Cache, Rules, check, close, differ, events, first_problem, per_world_size, run_all
from minidist.ddp import make_buckets as _minidist_buckets

WORLD_SIZES = (2, 3)
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
STEPS, BATCH, SEQ = 3, 12, 6  # BATCH divides over 2 and 3 ranks
CAPS = {"several": 0.004, "one bucket": None, "one per parameter": 0}
HANG_HINT = "Every rank must issue the same all-reduces in the same order and wait only for what it issued."

_OWN = "build the buckets, hooks and all-reduces yourself: torch's wrapper is what you are writing"
RULES = Rules(
    collectives=frozenset({"broadcast", "all_reduce"}),
    collective_rule="exercise 03 moves data with dist.broadcast (construction) and "
                    "dist.all_reduce (the buckets) only",
    forbidden={**dict.fromkeys(("torch.nn.parallel:DistributedDataParallel", "torch.distributed.fsdp:"
                                "FullyShardedDataParallel", "torch.distributed.fsdp:fully_shard"), _OWN),
               "minidist.ddp:DDP": "minidist's DDP is the answer: write BucketedDDP yourself",
               "minidist.ddp:make_buckets": "minidist's make_buckets is the answer: write your own"})


def reference_make_buckets(module: nn.Module, bucket_cap_mb: float | None) -> list:
    """minidist.ddp.make_buckets with the exercise's signature."""
    return _minidist_buckets(_reversed_trainable(module), bucket_cap_mb)


def reference_bucket_by_dtype(module: nn.Module, bucket_cap_mb: float | None, cut=_minidist_buckets) -> list:
    """bucket_by_dtype from minidist.ddp.make_buckets (the checks pass the rule written here as `cut`)."""
    order = _reversed_trainable(module)
    return [b for dtype in dict.fromkeys(p.dtype for p in order)
            for b in cut([p for p in order if p.dtype == dtype], bucket_cap_mb)]


class Net(nn.Module):
    """A tied embedding/head weight, a frozen layer, a buffer, tensors of several sizes."""

    def __init__(self, V: int = 50, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.frozen = nn.Linear(d, d).requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("gain", 0.5 + torch.rand(d))

    def forward(self, x, y):
        h = self.body(self.frozen(self.emb(x)) * self.gain)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class Scrambled(nn.Module):
    """Registered a, b, c (of different sizes); forward uses c, then b, then a."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(i, o, bias=False) for i, o in ((5, 2), (4, 5), (3, 4)))

    def forward(self, x, y):
        return F.mse_loss(self.a(torch.tanh(self.b(torch.tanh(self.c(x))))), y)


def _mixed() -> nn.Module:
    """float32 and bfloat16 layers, one weight frozen."""
    m = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 8).bfloat16(), nn.Linear(8, 8),
                      nn.Linear(8, 4).bfloat16(), nn.Linear(4, 4))
    m[2].weight.requires_grad_(False)
    return m


def _reversed_trainable(module):
    return [p for p in reversed(list(module.parameters())) if p.requires_grad]


def _rule(params, cap_mb):
    """Consecutive runs of `params`, a new one when the next would go over the cap."""
    cap = float("inf") if cap_mb is None else cap_mb * 2 ** 20
    buckets, used = [], 0
    for p in params:
        if not buckets or used + p.nbytes > cap:
            buckets, used = buckets + [[]], 0
        buckets[-1].append(p)
        used += p.nbytes
    return buckets


def _sizes(module, cap_mb):
    return [sum(p.numel() for p in b) for b in _rule(_reversed_trainable(module), cap_mb)]


class _Marks:
    """Marks ("grad", name, i) when `name`'s gradient is complete and ("wait", None, i) when the
    code under test waits for a collective, i being the number of events() recorded by then."""

    def __init__(self, model):
        self.log = []  # what is logged outside backward() is dropped at its start
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda _, name=name: self.log.append(("grad", name, len(events()))))

    def backward(self, loss) -> dict:
        """Run loss.backward(); what it issued, and the marks, numbered from its start."""
        start, self.log = len(events()), []
        Work, real = torch._C._distributed_c10d.Work, torch._C._distributed_c10d.Work.wait

        def wait(work, *a, **k):
            self.log.append(("wait", None, len(events())))
            return real(work, *a, **k)
        Work.wait = wait
        try:
            loss.backward()
        finally:
            Work.wait = real
        issued = [(e.kind, e.shapes) for e in events()[start:]]
        return {"issued": issued, "marks": [(k, name, i - start) for k, name, i in self.log]}


def _grads(model) -> dict:
    return {k: p.grad for k, p in model.named_parameters() if p.requires_grad}


def _grad_problem(step, got: dict, want: dict, local: dict, n: int) -> str | None:
    for name, w in want.items():
        g = got[name]
        if g is None:
            return f"step {step}: {name}.grad is None when loss.backward() returns"
        if close(g, w):
            continue
        where = f"step {step}: {name}.grad differs from one process's gradient on the whole batch"
        if close(g, n * w):
            return f"{where}: it is {n} times as large"
        if close(g, local[name]):
            return f"{where}: it equals this rank's own gradient, on its part of the batch"
        return differ(f"step {step}: {name}.grad", g, w, "one process's gradient on the whole batch", atol=1e-6)


def _train_part(cap, fns: dict, r: int, n: int) -> dict:
    torch.manual_seed(0)
    oracle = Net()  # one process, the whole batch
    torch.manual_seed(0 if r == 0 else 100 + r)  # rank 0 starts as the oracle, the others not
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    marks, start = _Marks(model), len(events())
    ddp = fns["BucketedDDP"](model, bucket_cap_mb=cap)
    out = {"built": [(e.kind, e.shapes) for e in events()[start:]], "steps": [], "problem": None,
           "buckets": _sizes(model, cap), "construction": None}
    for k, v in model.state_dict().items():  # every rank gathers every tensor: no early exit
        what, everyone = "buffer" if k == "gain" else "parameter", [torch.empty_like(v) for _ in range(n)]
        dist.all_gather(everyone, v.contiguous())
        if not torch.equal(v, before[k] if r == 0 else everyone[0]):
            out["construction"] = out["construction"] or (
                f"construction changed its {what} {k}" if r == 0 else
                f"after construction its {what} {k} differs from rank 0's")
    for step in range(STEPS):
        x, y = torch.randint(0, 50, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]
        oracle(xs, ys).backward()
        local = {k: v.clone() for k, v in _grads(oracle).items()}
        oracle.zero_grad(set_to_none=True)
        oracle(x, y).backward()
        out["steps"].append(marks.backward(ddp(xs, ys)))
        out["problem"] = out["problem"] or _grad_problem(  # every rank runs every step: no early exit
            step, _grads(model), _grads(oracle), local, n)
        with torch.no_grad():  # SGD, lr 0.1, on both
            for p in (q for m in (oracle, model) for q in m.parameters() if q.grad is not None):
                p.sub_(0.1 * p.grad)
                p.grad = None
    want = dict(oracle.named_parameters())
    bad = [k for k, p in model.named_parameters() if not close(p.detach(), want[k].detach())]
    if bad and not out["problem"]:
        out["problem"] = f"after {STEPS} SGD steps, parameter {bad[0]} differs from one process's"
    return out


def _order_part(fns: dict, r: int, n: int) -> dict:
    torch.manual_seed(0)
    model = Scrambled()
    marks, ddp = _Marks(model), fns["BucketedDDP"](model, bucket_cap_mb=0)
    index = {k: i for i, (k, _) in enumerate(reversed(list(model.named_parameters())))}  # bucket of each
    out = {"built": [(e.kind, e.shapes) for e in events()], "steps": [], "buckets": _sizes(model, 0)}
    g = torch.Generator().manual_seed(7 + r)
    for _ in range(2):
        step = marks.backward(ddp(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)))
        step["filled"] = [index[name] for kind, name, _ in step["marks"] if kind == "grad"]
        out["steps"].append(step)
        model.zero_grad(set_to_none=True)
    return out


_ORDER = ("a model whose forward uses its layers in the reverse of their registration order, one bucket per "
          "parameter, ")
PARTS = {**{name: functools.partial(_train_part, cap) for name, cap in CAPS.items()}, "order": _order_part}
_CACHE = Cache()


def _runs(impl, *parts):
    """(where, per-rank results) of each part: "several" on every world size, the rest on the first."""
    key = (impl.BucketedDDP, WORLD_SIZES, TIMEOUT_S)  # tests change the last two
    plan = {n: [p for p in PARTS if p == "several" or n == WORLD_SIZES[0]] for n in WORLD_SIZES}
    results = _CACHE.get(key, lambda: run_all(PARTS, {"BucketedDDP": impl.BucketedDDP}, plan,
                                              TIMEOUT_S, HANG_HINT))
    for part in parts:
        sizes = WORLD_SIZES if part == "several" else WORLD_SIZES[:1]
        named = {"several": "", "order": _ORDER}.get(part, f"{part} (bucket_cap_mb={CAPS.get(part)}), ")
        for n, per_rank in per_world_size(results, part, sizes):
            yield f"{named}on {n} ranks", per_rank


def _steps(impl, *parts):
    """(where, the rank's results, what its backward did) of every rank's every step."""
    for where, per_rank in _runs(impl, *parts):
        for r, res in enumerate(per_rank):
            for step, s in enumerate(res["steps"]):
                yield f"{where}, rank {r}, step {step}", res, s


def _one_all_reduce_per_bucket(impl, *parts):
    for at, res, s in _steps(impl, *parts):  # a tuple of shapes: one all_reduce of several tensors
        got = [sh[0] if len(sh) == 1 else sh for kind, sh in s["issued"] if kind == "all_reduce"]
        filled = f"backward filled buckets {s['filled']}; " if "filled" in s else ""
        assert got == [(k,) for k in res["buckets"]], (
            f"{at}: {filled}the all_reduce calls sent tensors of shapes {got}; want the buckets' flat "
            f"buffers, in bucket index order: {res['buckets']} elements")


def _show(module, buckets):
    label = {id(p): k for k, p in module.named_parameters()}
    return [[label.get(id(p), "?") for p in b] for b in buckets]


@check("03", 2, "make_buckets: trainable, each once, reversed, filled up to the cap", hints=[
    "Which parameters take part, in which order? module.parameters() yields a tied weight once.",
    "Walk the trainable parameters from the last registered to the first, counting the current bucket's "
    "bytes (numel times element size).",
    "A new bucket when the next parameter would take the count over bucket_cap_mb * 2**20 (None: no "
    "limit) and the current one is not empty; a bucket exactly at the cap is fine."])
def _make_buckets(impl):
    from minidist.model import GPT, GPTConfig
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    gpt.wpe.requires_grad_(False)
    for model in (Net(), gpt):
        order = _reversed_trainable(model)
        exact = sum(p.nbytes for p in order[:4]) / 2 ** 20  # the cap met exactly
        for cap in (None, 0, 0.004, exact, exact - 2 ** -20, 0.01):  # at the cap, a byte under
            got = impl.make_buckets(model, cap)
            assert isinstance(got, (list, tuple)) and all(isinstance(b, (list, tuple)) for b in got), \
                f"make_buckets(cap={cap}) returned {type(got).__name__}, want a list of lists of parameters"
            got, want = _show(model, got), _show(model, _rule(order, cap))
            assert got == want, f"{type(model).__name__}, bucket_cap_mb={cap}: got buckets {got}, want {want}"


def _problems(impl, key, *parts):
    """Fail with the first rank's problem `key` (None: none) in each part."""
    for where, per_rank in _runs(impl, *parts):
        first_problem(f"{where}, rank {r}: {res[key]}" if res[key] else None
                      for r, res in enumerate(per_rank))


@check("03", 1, "construction copies rank 0's parameters and buffers to every rank", hints=[
    "The ranks build their models with different seeds: what must hold before the first forward?",
    "Which collective copies one rank's tensor to every other rank? Buffers count too.",
    "In __init__, for every parameter and buffer, copy rank 0's values in place, without autograd "
    "recording it."])
def _construction(impl):
    _problems(impl, "construction", "several")


_TRAIN_HINTS = [
    "After loss.backward() returns, p.grad must be the average over ranks of every rank's gradient: what "
    "does an all-reduce compute, and what is still missing?",
    "State to keep: per bucket one flat buffer with a view per parameter, which parameters are ready in "
    "this backward, each bucket's work, the next bucket to launch, whether this backward's "
    "end-of-backward callback is queued.",
    "The first hook of a backward queues _end_of_backward on autograd's engine (chapter 03, section 4); "
    "there: launch what is left, wait for every work, divide by the world size, put each view's values "
    "in its parameter's .grad, reset what belongs to one backward."]


@check("03", 3, "2 and 3 ranks, several buckets: SGD steps == one process on the whole batch",
       hints=_TRAIN_HINTS)
def _several(impl):
    _problems(impl, "problem", "several")


@check("03", 1, "one bucket (cap None) and one per parameter (cap 0) == one process", hints=[
    "Only these fail? Look at how the buckets are cut at the extremes, and at the last bucket's launch at "
    "the end of backward.", *_TRAIN_HINTS[1:]])
def _extremes(impl):
    _problems(impl, "problem", "one bucket", "one per parameter")


@check("03", 2, "overlap: async all_reduces start in the hooks, before backward's last gradient", hints=[
    "When does your first all-reduce start: while backward computes earlier layers, or after it is done?",
    "Launch a bucket's all-reduce from the hook that completes it; a synchronous one stops backward until "
    "it is summed.",
    "dist.all_reduce(buffer, async_op=True) returns a work at once; wait() on the works only in the "
    "end-of-backward callback."])
def _overlap(impl):
    for at, _, s in _steps(impl, "several"):
        marks = [kind for kind, _, _ in s["marks"]]
        assert "grad" in marks, f"{at}: no gradient was complete during backward"
        last = len(marks) - 1 - marks[::-1].index("grad")  # the last gradient's mark
        kinds = [kind for kind, _ in s["issued"]]
        assert "all_reduce" in kinds[:s["marks"][last][2]], (
            f"{at}: none of the {kinds.count('all_reduce')} all_reduce calls started "
            "before the last gradient was complete")
        assert "wait" not in marks[:last], (
            f"{at}: backward waited for a collective before its last gradient was complete "
            f"({marks[:last].count('wait')} waits, the first after {marks.index('wait')} gradients)")


@check("03", 1, "one all_reduce per bucket per backward, of its flat buffer, in bucket order", hints=[
    "How many all-reduces does one backward issue, and how large is each?",
    "One all-reduce per bucket, of the bucket's flat buffer: not one per parameter, not the whole model "
    "at once."])
def _one_per_bucket(impl):
    _one_all_reduce_per_bucket(impl, *CAPS)


@check("03", 2, "launch order: bucket index order on every rank, even when backward fills them out of order",
       hints=["Ranks pair collectives by the order they are issued. What if gradients complete in another "
              "order than the buckets?",
              "Keep the index of the next bucket to launch; a full bucket further on waits for the ones "
              "before it.",
              "After each hook, launch buckets while the one next in line is full, moving the line on each "
              "time."])
def _launch_order(impl):
    for where, per_rank in _runs(impl, *PARTS):
        seqs = [[res["built"]] + [s["issued"] for s in res["steps"]] for res in per_rank]
        for r, seq in enumerate(seqs[1:], 1):
            for j, (mine, first) in enumerate(zip(seq, seqs[0])):
                assert mine == first, (f"{where}, {f'backward {j - 1}' if j else 'construction'}: "
                                       f"rank {r} issued {mine}, rank 0 issued {first} (kinds, shapes)")
    _one_all_reduce_per_bucket(impl, "order")


@check("03", 2, "find the bug: bucket_by_dtype gives the same buckets on every rank, every run", hints=[
    "Run it on two fresh builds of the same model and compare: does anything in it depend on where the "
    "parameters live in memory?",
    "In what order does bucket_by_dtype visit the parameters, and what order does its docstring ask for?",
    "What decides the order in which a Python set of tensors is iterated?"])
def _bucket_by_dtype(impl):
    for cap in (None, 0, max(p.nbytes for p in _mixed().parameters()) / 2 ** 20):
        models = [_mixed() for _ in range(6)]  # six builds of the same model, as six ranks or runs make it
        got = [_show(m, impl.bucket_by_dtype(m, cap)) for m in models]
        want = _show(models[0], reference_bucket_by_dtype(models[0], cap, _rule))
        wrong = [g for g in got if g != want]
        assert not wrong, (f"bucket_cap_mb={cap}: {len(wrong)} of {len(got)} builds of the same model "
                           f"got other buckets than {want}, such as {wrong[0]}; the builds gave "
                           f"{len({repr(g) for g in got})} different bucketings")
