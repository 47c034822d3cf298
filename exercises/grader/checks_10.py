"""Graded checks of exercise 10 (exercises/10_tensor_parallel.py).

(a) and (c) run on 2 and 3 ranks; each rank regenerates every input from seeds and runs the
oracle (F.cross_entropy of the full logits; the block in one process) beside the code under
test. (b) runs in one process: attention on every rank's shard, c_proj's partial outputs summed.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import minidist.tensor_parallel.cost
import minidist.tensor_parallel.gpt
import minidist.tensor_parallel.layers
from exercises.grader import Cache, Rules, check, differ, events, first_problem, per_world_size, randn, run_all

WORLD_SIZES = (2, 3)
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung
RTOL = ATOL = 1e-5  # fp32, values of order 1: the same sums, grouped differently
HANG_HINT = "Every rank must call the same collectives, in the same order, with the same sizes."


def _defined_in(*modules) -> dict:
    """Every public function and class these modules define, as Rules.forbidden entries."""
    rule = "minidist.tensor_parallel holds this exercise's answers (what --reference grades): write them yourself"
    return {f"{m.__name__}:{name}": rule for m in modules for name, obj in vars(m).items()
            if not name.startswith("_") and callable(obj) and getattr(obj, "__module__", None) == m.__name__}


_block = lambda n_total, r, n: slice(*minidist.tensor_parallel.layers.shard_range(n_total, r, n))  # noqa: E731
_TORCH_TP = "exercise 10 writes tensor parallelism with torch.distributed's collectives, not DTensor"
RULES = Rules(
    collectives=frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                           "reduce_scatter_tensor"}),
    collective_rule="exercise 10 moves data with all_reduce, all_gather and reduce_scatter only",
    forbidden={
        "torch.distributed.tensor:DTensor": _TORCH_TP, "torch.distributed.tensor:distribute_tensor": _TORCH_TP,
        "torch.distributed.tensor.parallel:parallelize_module": _TORCH_TP,
        **_defined_in(minidist.tensor_parallel.layers, minidist.tensor_parallel.gpt, minidist.tensor_parallel.cost)})


# --------------------------------------------------------------------- helpers

_WORDS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "all_gather_into_tensor": "all-gather",
          "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter"}


def _moved(evs) -> list:
    """[(kind, bytes)] of these events: the larger of what each sent and received."""
    return [(_WORDS.get(e.kind, e.kind), max(e.sent, e.received)) for e in evs]


def _said(moved: list) -> str:
    return ", ".join(f"{k} of {b} bytes" for k, b in moved) or "nothing"


# --------------------------------------------------------------------- (a) the loss, on the ranks

B, T = 2, 6
GRAD_OUT = 3.0  # backward runs from 3 * loss: the incoming gradient counts
CE_CASES = [  # (V, scale, shift, boost of rank 0's block): plain; uneven, large, the max on rank 0
    (96, 2.0, 0.0, 0.0), (97, 3.0, 90.0, 12.0)]
BYTES_PER_TOKEN = 32  # what (a) may move: 8 fp32 numbers a token (three do)


def _ce_part(fns: dict, r: int, n: int) -> list:
    out = []
    for case, (V, scale, shift, boost) in enumerate(CE_CASES):
        mine = _block(V, r, n)
        g = torch.Generator().manual_seed(700 + case)
        full = torch.randn(B, T, V, generator=g) * scale + shift
        full[..., :V // n] += boost
        targets = torch.randint(V, (B, T), generator=g)
        ref = full.clone().requires_grad_()
        want = F.cross_entropy(ref.view(-1, V), targets.view(-1))
        (GRAD_OUT * want).backward()
        logits = full[..., mine].clone().requires_grad_()
        ev = events()
        k0 = len(ev)
        loss = fns["vocab_parallel_cross_entropy"](logits, targets.clone(), mine.start, dist.group.WORLD)
        k1 = len(ev)
        where = (f"rank {r}, V={V}{f', logits around {shift:g}' if shift else ''} (this rank's "
                 f"ids {mine.start}:{mine.stop})")
        ok = isinstance(loss, torch.Tensor) and loss.numel() == 1
        problem = differ("the loss", loss.reshape(()) if ok else loss, want)
        if ok and loss.requires_grad:  # every rank alike: a backward with collectives must not hang
            (GRAD_OUT * loss.reshape(())).backward()
            problem = problem or differ(f"logits.grad after ({GRAD_OUT:g} * loss).backward()",
                                         logits.grad, ref.grad[..., mine])
        elif ok:
            problem = problem or "the loss does not require grad: backward cannot reach the logits"
        out.append({"where": where, "problem": problem, "fwd": _moved(ev[k0:k1]),
                    "bwd": _moved(ev[k1:]), "logit_bytes": logits.numel() * 4})
    return out


# --------------------------------------------------------------------- (c) the block, on the ranks

C, HID = 8, 12  # T and HID divide over 2 and 3 ranks
P_DROP, SEED = 0.5, 1234


def _sp_setup(r: int, n: int):
    pos, hid = _block(T, r, n), _block(HID, r, n)
    x, w_fc, w_proj = randn(600, B, T, C), randn(601, HID, C) * 0.5, randn(602, C, HID) * 0.5
    return pos, hid, x, w_fc, w_proj


def _mlp(x, w_fc, w_proj):
    return F.linear(F.gelu(F.linear(x, w_fc), approximate="tanh"), w_proj)


def _sp_grad_part(fns: dict, r: int, n: int) -> dict:
    pos, hid, x_full, w_fc, w_proj = _sp_setup(r, n)
    gy = randn(603, B, T, C)
    xo, ao, bo = (t.clone().requires_grad_() for t in (x_full, w_fc, w_proj))
    want = xo + _mlp(xo, ao, bo)
    want.backward(gy)
    x = x_full[:, pos].clone().requires_grad_()
    a, b = w_fc[hid].clone().requires_grad_(), w_proj[:, hid].clone().requires_grad_()
    ev = events()
    y = fns["sequence_parallel_mlp"](x, a, b, dist.group.WORLD, 0.0)
    k = len(ev)
    problems = [differ("the output (this rank's positions)", y, want[:, pos])]
    if isinstance(y, torch.Tensor) and y.shape == want[:, pos].shape and y.requires_grad:
        y.backward(gy[:, pos])
        problems += [differ("x.grad", x.grad, xo.grad[:, pos]),
                     differ("w_fc.grad", a.grad, ao.grad[hid]),
                     differ("w_proj.grad", b.grad, bo.grad[:, hid])]
    return {"problem": "; ".join(p for p in problems if p) or None,
            "fwd": _moved(ev[:k]), "bwd": _moved(ev[k:])}


def _sp_dropout_part(fns: dict, r: int, n: int) -> dict:
    pos, hid, x_full, w_fc, w_proj = _sp_setup(r, n)
    x, a, b = x_full[:, pos], w_fc[hid], w_proj[:, hid]
    kept_value = _mlp(x_full, w_fc, w_proj)[:, pos] / (1 - P_DROP)
    out = {"problem": None, "masks": [], "stream": None}
    torch.manual_seed(SEED)  # the default stream, seeded alike on every rank
    with torch.no_grad():
        for call in range(3):
            if call == 2:
                torch.manual_seed(SEED)  # the same state again: the same masks
            d = fns["sequence_parallel_mlp"](x, a, b, dist.group.WORLD, P_DROP) - x
            if call == 0:
                out["stream"] = torch.rand(4).tolist()
            kept = (d - kept_value).abs() <= ATOL + RTOL * kept_value.abs()
            if not bool((kept | (d.abs() <= ATOL)).all()):
                out["problem"] = (f"rank {r}: with p={P_DROP}, some elements of output - x are "
                                  "neither 0 nor one process's MLP branch scaled by 1/(1-p)")
                return out
            out["masks"].append(kept.flatten().tolist())
    return out


PARTS = {"ce": _ce_part, "sp_grad": _sp_grad_part, "sp_dropout": _sp_dropout_part}
NAMES = ("vocab_parallel_cross_entropy", "sequence_parallel_mlp")
_CACHE = Cache()


def _part(impl, name: str):
    fns = {k: getattr(impl, k) for k in NAMES}
    results = _CACHE.get((*fns.values(), WORLD_SIZES, TIMEOUT_S), lambda: run_all(
        PARTS, fns, WORLD_SIZES, TIMEOUT_S, HANG_HINT))
    return per_world_size(results, name, WORLD_SIZES)


# --------------------------------------------------------------------- the checks

@check("10", points=3, name="vocab_parallel_cross_entropy == F.cross_entropy of the full logits: the loss and logits.grad", hints=[
    "What does the loss of one token need from the logits the other ranks hold? Not their "
    "values: how few numbers per token could each rank contribute?",
    "log softmax(z)[target] = (z_target - m) - log sum exp(z - m), with m the largest logit. "
    "Over the ranks, m is a max, the sum of exp(z - m) a sum, and z_target a sum in which "
    "only the rank holding the target contributes: one all-reduce of B*T numbers each.",
    "Make it a torch.autograd.Function. The gradient of the mean loss with respect to a "
    "logit is (softmax - onehot(target)) / (B*T), and this rank's columns of the softmax "
    "need only its own logits and the two all-reduced numbers kept from forward; backward "
    "multiplies by the gradient it is handed."])
def _ce_values(impl):
    for n, per_rank in _part(impl, "ce"):
        first_problem(f"on {n} ranks, {res['where']}: {res['problem']}" if res["problem"] else None
                      for cases in per_rank for res in cases)


@check("10", points=2, name="vocab_parallel_cross_entropy's collectives: all-reduces of a few numbers per token, none in backward", hints=[
    "What did each of your collectives carry, in bytes? Which of them grows with the "
    "vocabulary rather than with the number of tokens?",
    "Gathering the logits, or all-reducing anything of their size, undoes the split: only "
    "per-token numbers may travel. And in backward: what from the other ranks does this "
    "rank's gradient need that forward has not already brought?",
    "Keep in the autograd Function's ctx what backward needs (this rank's softmax, where "
    "the target is); an all-reduce that autograd can differentiate through adds its own "
    "collective to backward."])
def _ce_collectives(impl):
    for n, per_rank in _part(impl, "ce"):
        for cases in per_rank:
            for res in cases:
                where, tokens = f"on {n} ranks, {res['where']}", B * T
                limit = BYTES_PER_TOKEN * tokens
                assert all(k == "all-reduce" for k, _ in res["fwd"]) and sum(b for _, b in res["fwd"]) <= limit, (
                    f"{where}: forward moved {_said(res['fwd'])}; want only all-reduces of at most "
                    f"{limit} bytes in all ({BYTES_PER_TOKEN} a token for these {tokens} tokens; "
                    f"this rank's logits are {res['logit_bytes']} bytes)")
                assert not res["bwd"], f"{where}: backward moved {_said(res['bwd'])}; want nothing"


@check("10", points=2, name="qkv_shard: attention on each rank's heads, its c_proj columns summed over the ranks == the full attention", hints=[
    "Which rows of the fused [3C, C] weight make head h's query, its key and its value? "
    "Draw the weight as three stacked blocks.",
    "Rank r's heads are the r-th block of n_head/t heads: their queries are one block of "
    "C/t rows in the query part, and their keys and values the same block in the other two. "
    "Cutting the fused weight into t blocks of 3C/t rows gives rank 0 queries only.",
    "Take the same block of C/t rows from each of the three parts and stack them in the "
    "order query, key, value; cut the bias the same way."])
def _qkv(impl):
    Cq, H = 24, 6
    x = randn(800, B, 5, Cq)
    with torch.no_grad():
        for bias, t in ((bias, t) for bias in (True, False) for t in (1, 2, 3, 6)):
            torch.manual_seed(8)
            c_attn, c_proj = nn.Linear(Cq, 3 * Cq, bias=bias), nn.Linear(Cq, Cq, bias=bias)
            heads = _attention(F.linear(x, c_attn.weight, c_attn.bias), H)  # (B, T, C) before c_proj
            want, total, wrong = F.linear(heads, c_proj.weight, c_proj.bias), 0, []
            for r in range(t):
                w, b = impl.qkv_shard(c_attn.weight.clone(), c_attn.bias.clone() if bias else None, H, r, t)
                for what, got, shape in (("weight", w, (3 * Cq // t, Cq)), ("bias", b, (3 * Cq // t,) if bias else None)):
                    assert (got is None if shape is None else isinstance(got, torch.Tensor) and got.shape == shape), (
                        f"qkv_shard(c_attn with bias={bias}, rank={r}, world_size={t}): the {what} is "
                        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else got}, want {shape}")
                cols, mine = _block(Cq, r, t), _attention(F.linear(x, w, b), H // t)
                wrong.append(differ(f"the output of rank {r}'s heads {r * H // t}-{(r + 1) * H // t - 1}",
                                     mine, heads[..., cols], "the full attention's"))
                total = total + F.linear(mine, c_proj.weight[:, cols])
            problem = differ(f"c_attn bias={bias}, on {t} ranks: the attention output summed over the ranks",
                              total + (c_proj.bias if bias else 0), want, "the full attention's")
            assert not problem, "; ".join([problem, *filter(None, wrong)])


def _attention(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """Causal attention of n_head heads from a fused (B, T, 3D) q|k|v, merged to (B, T, D)."""
    Bq, Tq, D3 = qkv.shape
    q, k, v = (z.view(Bq, Tq, n_head, D3 // 3 // n_head).transpose(1, 2) for z in qkv.split(D3 // 3, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bq, Tq, D3 // 3)


@check("10", points=2, name="find the bug: sequence_parallel_mlp at p=0: output, gradients, collectives", hints=[
    "Run the block at p=0 on 2 ranks beside one process: which values differ, by what "
    "factor, and does the factor change with the number of ranks?",
    "Follow the gradient back through _GatherPositions: what does each collective in its "
    "backward do to it? Which of them sums over the ranks?",
    "The all-gather's backward is a single reduce-scatter: it already sums every rank's "
    "gradient of each position and leaves each rank its own. Anything that sums before it "
    "sums a second time, and moves bytes the contract does not allow."])
def _sp_grad(impl):
    want = sorted([("all-gather", 4 * B * T * C), ("reduce-scatter", 4 * B * T * C)])
    for n, per_rank in _part(impl, "sp_grad"):
        first_problem(f"on {n} ranks, rank {r}: {res['problem']}" if res["problem"] else None
                      for r, res in enumerate(per_rank))
        for r, res in enumerate(per_rank):
            for phase in ("fwd", "bwd"):
                assert sorted(res[phase]) == want, (
                    f"on {n} ranks, rank {r}, {'forward' if phase == 'fwd' else 'backward'} moved "
                    f"{_said(res[phase])}; the contract: one all-gather and one reduce-scatter of "
                    f"B*T*C = {B * T * C} fp32 numbers ({4 * B * T * C} bytes) each")


@check("10", points=2, name="find the bug: sequence_parallel_mlp at p>0: dropout masks and the default random stream", hints=[
    "Seed every rank alike, run the block with p=0.5, and print the mask of the whole "
    "sequence, each rank's block side by side: what pattern do you see?",
    "Where does F.dropout draw its numbers from, and in what state is that stream on each "
    "rank? The replicated activations elsewhere need it the same on every rank.",
    "Give the call a random state of its own: forked from the default stream (so that "
    "recomputation replays it and the next call differs) and made different per rank, "
    "with the default stream restored afterwards. Chapter 10, section 4, on random numbers."])
def _sp_dropout(impl):
    for n, per_rank in _part(impl, "sp_dropout"):
        first_problem(f"on {n} ranks, {res['problem']}" if res["problem"] else None for res in per_rank)
        masks = [res["masks"] for res in per_rank]
        assert not all(all(m) for ms in masks for m in ms[:2]), (
            f"on {n} ranks, p={P_DROP}: nothing was dropped in two calls")
        w = T // n
        for r in range(1, n):
            for q in range(r):
                assert masks[r][0] != masks[q][0], (
                    f"on {n} ranks, p={P_DROP}: the mask over the whole sequence repeats: positions "
                    f"{r * w}:{(r + 1) * w} (rank {r}'s) are dropped exactly where positions "
                    f"{q * w}:{(q + 1) * w} (rank {q}'s) are, in all {len(masks[r][0])} elements")
        streams = [[round(v, 4) for v in res["stream"]] for res in per_rank]
        other = next((r for r, s in enumerate(streams) if s != streams[0]), None)
        assert other is None, (
            f"on {n} ranks: after the call the default random stream differs from rank to rank "
            f"(torch.rand(4) gives {streams[0]} on rank 0, {streams[other]} on rank {other})")
        for r, ms in enumerate(masks):
            assert ms[1] != ms[0], f"on {n} ranks, rank {r}: two calls in a row drew the same mask"
            assert ms[2] == ms[0], (
                f"on {n} ranks, rank {r}: run again from the same state of the default stream "
                "(torch.manual_seed again), the call drew another mask")


# ---- the answer key, `python -m exercises.grade 10 --reference`: minidist's own, in the exercise's signatures
reference_vocab_parallel_cross_entropy = minidist.tensor_parallel.gpt.vocab_parallel_cross_entropy


def reference_qkv_shard(weight, bias, n_head, rank, world_size):
    """The rows of c_attn that minidist's ParallelAttention gives rank `rank`."""
    layers, C = minidist.tensor_parallel.layers, weight.shape[1]
    a, b = layers.shard_range(C, rank, world_size)
    spec = (0, tuple((a + i * C, b + i * C) for i in range(3)))
    return layers.shard_of(weight, spec), None if bias is None else layers.shard_of(bias, spec)


def reference_sequence_parallel_mlp(x, w_fc, w_proj, group, p=0.0):
    layers = minidist.tensor_parallel.layers
    h = F.gelu(F.linear(layers.gather_sequence(x, group), w_fc), approximate="tanh")
    y = layers.reduce_scatter_sequence(F.linear(h, w_proj), group)
    if p > 0:
        with layers.tp_rng(group, x.device):
            y = F.dropout(y, p, training=True)
    return x + y
