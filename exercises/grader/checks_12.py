"""Graded checks of exercise 12 (exercises/12_context_parallel.py): (a), (c) in one process against SDPA over all
the keys; (b) on 2 and 3 ranks, each making the whole q, k, v from seeds, and its slice at its true positions."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises.grader import Rules, check, differ, events, first_problem, per_world_size, randn, ring_direction, run_all
from minidist.context_parallel.layout import positions

WORLD_SIZES, TIMEOUT_S, T = (2, 3), 20.0, 12  # 12 tokens: N or 2N chunks at N = 2, 3
_OURS = "minidist.context_parallel holds this exercise's answers (what --reference grades): write them yourself"
_MINE = ("ring:ring_attention", "ring:merge", "allgather:allgather_attention", "ulysses:ulysses_attention")
RULES = Rules(frozenset({"send", "recv"}), "exercise 12 moves K and V by send/recv (isend/irecv) only: gathering "
              "the whole K, V to attend to it is the all-gather way, not the ring", {
                  "torch.distributed.tensor.experimental:context_parallel": "write the ring yourself",
                  **{f"minidist.context_parallel.{t}": _OURS for t in _MINE}})
_qkv = lambda seed, t: [randn(seed + i, 1, 2, t, 4) for i in range(3)]  # noqa: E731 - q, k, v: (B, H, t, D)


def reference_zigzag_attention(q, k, v, rank, n):  # the draft's answer: the mask from minidist's true positions
    mine = positions(k.shape[2], rank, n, "zigzag")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mine[:, None] >= torch.arange(k.shape[2]))


def _partial(q, k, v, keys):  # the attention of q over the keys `keys` only: (its output, its log-sum-exp)
    s = q @ k[:, :, keys].mT * q.shape[-1] ** -0.5
    return torch.softmax(s, -1) @ v[:, :, keys], torch.logsumexp(s, -1)


@check("12", 2, name="merge: two partial attentions merged == SDPA over the union of their keys, scores in the hundreds too", hints=[
    "A block's out is normalised over its own keys only: what share of the whole softmax do they carry, and how "
    "does its lse tell you?",
    "The whole lse is log(e^lse + e^block_lse), each out weighted by e^(its lse - the whole lse). At scores of 100 "
    "e^lse is inf: which form of the same sum exponentiates nothing positive?",
    "Subtract the larger lse before exponentiating (as torch.logaddexp does), and let a block of no keys (lse "
    "-inf) weigh 0, not nan (chapter 12, section 1)."])
def _merge(impl):
    q, k, v = _qkv(1200, 10)
    keys = torch.randperm(10, generator=torch.Generator().manual_seed(12))
    for q in (q, q * 100):  # x 100: scores of a few hundred, e^score far past float32
        want, lse, top = F.scaled_dot_product_attention(q, k, v), _partial(q, k, v, keys)[1], (q @ k.mT).max() / 2
        for a, b in ((keys[:3], keys[3:]), (keys[:0], keys)):
            got = impl.merge(*_partial(q, k, v, a), *_partial(q, k, v, b))
            where = f"merging the attention over {len(a)} keys into the one over {len(b)} (scores up to {top:.0f})"
            assert isinstance(got, tuple) and len(got) == 2, f"{where}: got a {type(got).__name__}, want (out, lse)"
            first_problem([differ(f"{where}: out", got[0], want, "SDPA's over all 10 keys"),
                           differ(f"{where}: lse", got[1], lse, "torch.logsumexp's over all 10 keys")])


def _ring_part(fns: dict, r: int, n: int) -> list:
    problems = []
    for causal, layout in ((c, lay) for c in (False, True) for lay in ("contiguous", "zigzag")):
        (q, k, v), mine, k0 = _qkv(1300 + causal, T), positions(T, r, n, layout), len(events())
        got = fns["ring_attention"](*(x[:, :, mine].clone() for x in (q, k, v)), dist.group.WORLD, causal, layout)
        call, most = f"ring_attention(causal={causal}, layout={layout!r})", (n - 1) * 2 * k.nbytes // n
        where, sent = f"on {n} ranks, rank {r}, {call} (positions {mine.tolist()})", sum(e.sent for e in events()[k0:])
        problems.append(differ(f"{where}: the output", got, F.scaled_dot_product_attention(
            q, k, v, is_causal=causal)[:, :, mine], "SDPA's on the whole sequence") or ring_direction(call, k0, r, n) or (
            None if sent <= most else f"{where}: it sent {sent} bytes, want at most {most} (N-1 blocks of K, V)"))
    return problems


@check("12", 4, name="ring_attention == SDPA on the whole sequence at this rank's positions, K, V around the ring", hints=[
    "At step t of N, whose keys and values does rank r hold, and to which neighbour do they go next? What must a "
    "rank have posted before it waits, so that no two neighbours wait on each other?",
    "Keep a running (out, lse) per query from (0, -inf) and merge() each block into it. With a causal mask, which "
    "blocks lie wholly in the future of this rank's queries, and which need a mask?",
    "Mask by true positions, not local indices: a zigzag rank holds chunks r and 2N-1-r, and its two query chunks "
    "meet each key block differently (chapter 12, sections 2 and 3)."])
def _ring(impl):
    results = run_all({"ring": _ring_part}, {"ring_attention": impl.ring_attention}, WORLD_SIZES, TIMEOUT_S,
                      "A send waits for its receive: post each step's send and receive together (isend, irecv).")
    for _, per_rank in per_world_size(results, "ring", WORLD_SIZES):
        first_problem(p for ps in per_rank for p in ps)


@check("12", 2, name="find the bug: draft_zigzag_attention == SDPA's causal attention on every zigzag rank, 2 to 4 ranks", hints=[
    "Which of a rank's queries differ (the report's index is [batch, head, query, feature]): its first chunk's, "
    "or its second's?",
    "Write out, for 2N = 4 chunks of c tokens, the true positions of rank 1's tokens, then the draft's: agreed?",
    "Chunk 2N-1-r is r chunks from the end: how many chunks after chunk r does it start? (chapter 12, section 3)"])
def _draft(impl):
    q, k, v = _qkv(1400, 24)  # 24 tokens: 2N chunks at N = 2, 3, 4
    want, wrong, right = F.scaled_dot_product_attention(q, k, v, is_causal=True), [], []
    for n, r in ((n, r) for n in (2, 3, 4) for r in range(n)):
        mine = positions(24, r, n, "zigzag")
        p = differ(f"on {n} ranks, rank {r}: the output", impl.draft_zigzag_attention(q[:, :, mine], k, v, r, n),
                    want[:, :, mine], "SDPA's causal attention on the whole sequence")
        (wrong if p else right).append(p or f"rank {r} of {n}")
    assert not wrong, f"{wrong[0]}; right on {', '.join(right) or 'none'} of the 9 cases"
