"""Context parallelism by all-to-all over heads (DeepSpeed-Ulysses): trade the sequence
split for a head split, attend, trade back.
Chapter 12 (chapters/12_context_parallel.md). Exercised by tests/test_context_parallel.py.

Heads never interact in attention, so a rank holding H/N heads over the whole sequence
can attend alone. An all-to-all turns (B, H, T_local, D) sequence shards into (B, H/N, T, D)
head shards: rank r sends heads block j of its tokens to rank j and receives its own heads
block of everyone's tokens. Four all-to-alls a step (q, k, v there, the output back), each
sending (N-1)/N of a slice, however large N is, but N can be no more than the heads.
The gathered sequence is in rank order. Contiguous, that is the true order, and attention is
causal as in one process; zigzag, its tokens are put in true order first (an index of T
rows) and back after, so no T x T mask is ever made and SDPA keeps its fused causal kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist import comm

from .layout import check_slices, positions, rank_and_size


def _seq_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(B, H, T_local, D) this rank's tokens -> (B, H/N, T, D) this rank's heads."""
    B, H, Tl, D = x.shape
    send = x.reshape(B, n, H // n, Tl, D).transpose(0, 1).contiguous()  # [j]: heads block j
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)  # recv[s]: rank s's tokens, our heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * Tl, D)


def _heads_to_seq(y: torch.Tensor, group, n: int) -> torch.Tensor:
    """(B, H/N, T, D) this rank's heads -> (B, H, T_local, D) this rank's tokens."""
    B, h, T, D = y.shape
    send = y.reshape(B, h, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()  # [s]: rank s's tokens
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)  # recv[j]: our tokens, heads block j
    return recv.transpose(0, 1).reshape(B, n * h, T // n, D)


class _SeqToHeads(torch.autograd.Function):
    """The all-to-all as an autograd step: its gradient is the all-to-all back."""
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _seq_to_heads(x, group, n)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.n), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, n):
        ctx.group, ctx.n = group, n
        return _heads_to_seq(y, group, n)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.n), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                      causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """ring_attention's contract (q, k, v of shape (B, H, T_local, D) as split_sequence cut
    them; this rank's slice of the output), by all-to-all over heads; H must divide by N."""
    _, n = rank_and_size(group)
    check_slices("ulysses_attention", q, k, v, n, layout)
    if q.shape[1] % n:
        raise ValueError(f"ulysses_attention: {q.shape[1]} heads do not split over {n} ranks: use a "
                         f"head count divisible by {n}, or ring_attention / allgather_attention")
    qh, kh, vh = (_SeqToHeads.apply(t, group, n) for t in (q, k, v))
    if causal and layout != "contiguous":  # gathered token i sits at true position order[i]
        T = qh.shape[-2]
        order = torch.cat([positions(T, s, n, layout) for s in range(n)]).to(q.device)
        inv = torch.argsort(order)  # true position j -> its gathered index
        out = F.scaled_dot_product_attention(qh[..., inv, :], kh[..., inv, :], vh[..., inv, :],
                                             is_causal=True)[..., order, :]
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    return _HeadsToSeq.apply(out, group, n)
