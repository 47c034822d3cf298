"""Context parallelism by all-gather (the Llama 3 way): gather the whole K and V on every
rank, then attend locally with this rank's queries, masked by true positions.
Chapter 12 (chapters/12_context_parallel.md). Exercised by tests/test_context_parallel.py.

Simpler than the ring and no step waits on a neighbour, at the price of holding the whole
K and V (N times the ring's slice; cheap when K, V have few heads, as with grouped-query
attention). The causal offsets: the gathered keys sit in rank order, so key positions are
the ranks' positions one after another (contiguous: 0..T-1; zigzag: chunks 0, 2N-1, 1,
2N-2, ...), and a query at true position i sees the keys at positions <= i. Backward sends
each rank's share of dK, dV back to the owner of those keys: a reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist import comm

from .layout import check_slices, gather_blocks, positions, rank_and_size
from .work import record_work


def _mask(T: int, r: int, n: int, layout: str, device) -> torch.Tensor:
    """(T_local, T) booleans: may this rank's query attend to the gathered key?"""
    q_pos = positions(T, r, n, layout)
    k_pos = torch.cat([positions(T, s, n, layout) for s in range(n)])
    return (q_pos[:, None] >= k_pos[None, :]).to(device)


def _attend(q, K, V, mask):
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)


def _reduce_scatter(full: torch.Tensor, group, n: int) -> torch.Tensor:
    """Sum over ranks of block r (along the sequence) of everyone's `full`, on rank r: the
    all-to-all sends block s to rank s, then each rank adds what it received."""
    send = torch.stack(full.chunk(n, dim=-2))  # (N, B, H, T_local, D), block s for rank s
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)
    return recv.sum(0)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        r, n = rank_and_size(group)
        kv = torch.stack([k, v])
        K, V = torch.cat(gather_blocks(kv, group), dim=-2).unbind(0)  # (B, H, T, D) each
        T = K.shape[-2]
        mask = _mask(T, r, n, layout, q.device) if causal else None
        record_work("allgather_attention", q.shape[-2] * T)  # SDPA computes every entry
        ctx.save_for_backward(q, K, V)
        ctx.mask, ctx.group, ctx.n = mask, group, n
        return _attend(q, K, V, mask)

    @staticmethod
    def backward(ctx, dout):
        q, K, V = ctx.saved_tensors
        with torch.enable_grad():  # recompute the local attention, here only: no messages
            q_, K_, V_ = (t.detach().requires_grad_() for t in (q, K, V))
            dq, dK, dV = torch.autograd.grad(_attend(q_, K_, V_, ctx.mask), (q_, K_, V_), dout)
        dk, dv = _reduce_scatter(torch.stack([dK, dV]), ctx.group, ctx.n).unbind(0)
        return dq, dk, dv, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                        causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """ring_attention's contract (q, k, v of shape (B, H, T_local, D) as split_sequence cut
    them; this rank's slice of the output), by all-gathering K and V."""
    check_slices("allgather_attention", q, k, v, rank_and_size(group)[1], layout)
    return _AllGatherAttention.apply(q, k, v, group, causal, layout)
