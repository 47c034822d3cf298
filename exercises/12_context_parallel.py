"""Exercise 12: context parallelism, attention over a sequence split across ranks, by a ring.

Goal. Each rank of a cp group holds one slice of the sequence: the queries, keys and values
of its own tokens, (B, H, T_local, D) each. Every query must still meet every key it may
see: in the ring, K and V blocks travel from rank to rank while each rank attends with its
queries to the block it holds, and the partial results merge exactly by log-sum-exp.
Read chapters/12_context_parallel.md, section 1 "The online softmax: two partial
attentions, one exact result", section 2 "The ring" (its forward), section 3 "The causal
mask on chunks, and the zigzag" and, for (c), section 4 "Two other ways" (all-gather).

Layouts, as split_sequence cuts T tokens over N ranks: "contiguous", N chunks, rank r holds
chunk r; "zigzag", 2N chunks, rank r holds chunk r then chunk 2N-1-r (in that order).

Write (each function's docstring is its contract):
(a) merge(out, lse, block_out, block_lse): two partial attentions of the same queries over
    disjoint keys -> (out, lse) of the attention over the keys of both;
(b) ring_attention(q, k, v, group, causal, layout): the forward of ring attention;
(c) find the bug in draft_zigzag_attention (the all-gather way's causal mask), in place.

What is graded (float32, rtol and atol 1e-5, against torch's attention of one process):
- (a) out equals F.scaled_dot_product_attention over the union of the keys, lse equals
  torch.logsumexp of its scores, with scores in the hundreds (e^score overflows float32)
  and with a first block of no keys at all (out 0, lse -inf: where a ring starts);
- (b) on 2 and 3 ranks, causal and not, contiguous and zigzag: each rank's output equals
  SDPA on the whole sequence at this rank's positions; rank r sends only to rank r+1 and
  receives only from rank r-1 (mod N), at most N-1 blocks of its K and V;
- (c) on 2, 3 and 4 ranks, every rank's output equals SDPA's causal attention at its
  positions.

Rules: data moves only by dist.send, recv, isend and irecv: no all_gather of K or V (that
is the all-gather way, not the ring); no torch.distributed.tensor.experimental's
context_parallel, nor minidist.context_parallel's attentions or merge (see the README,
"Exercises and grading").

Grade with `python -m exercises.grade 12` (a few seconds: it starts 2 and 3 processes),
`python -m exercises.grade 12 --hint` for a hint on the first failing check (again for the
next), `python -m exercises.grade 12 --reference` to grade minidist's instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - for the ring's messages
import torch.nn.functional as F


# ------------------------------------------------------------------ (a) the merge

def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint sets of keys -> the
    attention over the keys of both, as (out, lse). `out`, `block_out` (B, H, T_q, D): each
    the softmax-weighted sum of the values of its own keys only; `lse`, `block_lse`
    (B, H, T_q): the log of the sum of e^score over those keys (-inf where there are none).
    No e^score may be formed: scores can be far beyond float32's e^88."""
    raise NotImplementedError(
        "merge is not written yet: what does each partial result's lse tell you about the "
        "weight its keys carry in the whole softmax? (`python -m exercises.grade 12 --hint`)")


# ------------------------------------------------------------------ (b) the ring

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                   causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """This rank's slice of F.scaled_dot_product_attention(Q, K, V, is_causal=causal) on the
    whole sequence, where q, k, v (B, H, T_local, D) are this rank's slices of Q, K, V as
    `layout` cuts them over the ranks of `group` (scale 1/sqrt(D)). Forward only. K and V
    travel around the ring, from rank r to r+1, N-1 steps; each rank attends with its
    queries to the block it holds (skipping the blocks wholly in its queries' future, masking
    by true positions) and merges the result into its running (out, lse) with merge()."""
    raise NotImplementedError(
        "ring_attention is not written yet: at step t, whose K and V does rank r hold, and "
        "where do they go next? (`python -m exercises.grade 12 --hint`)")


# ------------------------------------------------------------------ (c) find the bug

def draft_zigzag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int,
                           n: int) -> torch.Tensor:
    """FIND THE BUG. The all-gather way for rank `rank` of `n` in the zigzag layout, as a
    colleague wrote it: q (B, H, T/n, D) holds this rank's queries (chunks rank and
    2n-1-rank of the 2n), k and v (B, H, T, D) the whole sequence's keys and values in true
    order (as if gathered). Returns this rank's causal attention output, (B, H, T/n, D):
    each query sees the keys at its own true position and before. It runs and returns the
    right shape, but not SDPA's values everywhere. Fix it in place."""
    T, c = k.shape[2], q.shape[2] // 2  # c tokens a chunk
    first = torch.arange(rank * c, (rank + 1) * c)  # chunk `rank`
    second = first + (2 * n - 2 * rank) * c  # its mirror, as far from the end as `first` from the start
    mine = torch.cat([first, second])  # the true positions of this rank's queries
    sees = mine[:, None] >= torch.arange(T)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees)


# Where minidist implements each (minidist.context_parallel; the draft's answer is an adapter
# in the grader on minidist's true positions); `--reference` grades these. Leave it as it is.
REFERENCE = {
    "merge": "minidist.context_parallel.ring:merge",
    "ring_attention": "minidist.context_parallel.ring:ring_attention",
    "draft_zigzag_attention": "exercises.grader.checks_12:reference_zigzag_attention",
}
