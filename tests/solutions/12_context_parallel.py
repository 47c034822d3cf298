"""Exercise 12 solved the way chapter 12 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


# ------------------------------------------------------------------ (a) the merge

def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each side's weight in the whole softmax is e^(its lse - the whole lse); both are
    formed relative to the larger lse, so nothing positive is exponentiated."""
    top = torch.maximum(lse, block_lse)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # no keys on either side yet
    a, b = torch.exp(lse - top), torch.exp(block_lse - top)
    total = a + b
    merged = (a.unsqueeze(-1) * out + b.unsqueeze(-1) * block_out) / total.unsqueeze(-1)
    return merged, top + torch.log(total)


# ------------------------------------------------------------------ (b) the ring

def _positions(T: int, rank: int, n: int, layout: str) -> torch.Tensor:
    """The true positions of the tokens `rank` holds."""
    if layout == "contiguous":
        c = T // n
        return torch.arange(rank * c, (rank + 1) * c)
    c = T // (2 * n)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)])


def _block(q, k, v, allowed):
    """Attention of q over the keys k, v only, where `allowed` (or everywhere if None):
    (out, lse); a query that may see none of them gets (0, -inf)."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return p @ v, lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                   causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """At step t rank r holds rank r-t's K, V: it passes them to r+1 while it takes the
    next from r-1, and attends to what it holds meanwhile."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    right, left = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    T = q.shape[2] * n
    q_pos = _positions(T, r, n, layout)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    held = torch.cat([k, v], dim=-1)  # one message a step: K and V side by side
    for t in range(n):
        if t < n - 1:
            incoming = torch.empty_like(held)
            reqs = [dist.isend(held, right, group=group), dist.irecv(incoming, left, group=group)]
        k_pos = _positions(T, (r - t) % n, n, layout)
        allowed = q_pos[:, None] >= k_pos[None, :] if causal else None
        if allowed is None or allowed.any():  # a block wholly in the future costs nothing
            block_out, block_lse = _block(q, *held.split(q.shape[-1], dim=-1), allowed)
            out, lse = merge(out, lse, block_out, block_lse)
        if t < n - 1:
            for req in reqs:
                req.wait()
            held = incoming
    return out


# ------------------------------------------------------------------ (c) the bug, fixed

def draft_zigzag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int,
                           n: int) -> torch.Tensor:
    """The draft with its mirror chunk where it belongs: chunk 2n-1-rank starts
    (2n-1-2*rank) chunks after chunk `rank` (the draft put it one chunk later)."""
    T, c = k.shape[2], q.shape[2] // 2
    first = torch.arange(rank * c, (rank + 1) * c)
    second = first + (2 * n - 1 - 2 * rank) * c
    mine = torch.cat([first, second])
    sees = mine[:, None] >= torch.arange(T)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees)


REFERENCE = {
    "merge": "minidist.context_parallel.ring:merge",
    "ring_attention": "minidist.context_parallel.ring:ring_attention",
    "draft_zigzag_attention": "exercises.grader.checks_12:reference_zigzag_attention",
}
