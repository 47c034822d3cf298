"""Ring attention, the plain form: each rank holds its slice of the sequence; K and V blocks
travel around the ring while each rank attends with its queries to the block it holds.
Chapter 12 (chapters/12_context_parallel.md). Exercised by tests/test_context_parallel.py.

Step t of N: rank r holds the K, V slice of rank r-t. It posts the send of that block to
r+1 and the receive of the next one from r-1, then computes, so the transfer hides behind
the arithmetic. Attention over a union of disjoint key blocks is exact from per-block
results: each block gives an output o_b (softmax over its keys only) and the log-sum-exp
l_b of its scores; two merge as

    l = log(e^l_1 + e^l_2),   o = e^(l_1 - l) o_1 + e^(l_2 - l) o_2

(the online softmax; logaddexp subtracts the running max, so nothing overflows). Backward
is the same ring again: K, V travel as before, and dK, dV accumulators travel with them,
each rank adding its queries' share; one more hop brings each home. No rank ever holds
more than its own slice and two blocks in flight, never the whole K or V.

Causal masks work on chunks of the sequence (layout.py): a query chunk skips key chunks
wholly in its future, masks the one on the diagonal, and attends fully to earlier ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm

from .layout import check_slices, chunk_ids, global_rank, rank_and_size
from .work import record_work


def _pairs(r: int, s: int, n: int, layout: str, causal: bool) -> list[tuple[int, int, bool]]:
    """This step's blocks: (which of rank r's query chunks, which of rank s's key chunks,
    whether it is on the diagonal and so masked). Chunks wholly in the future are absent."""
    pairs = []
    for a, i in enumerate(chunk_ids(r, n, layout)):
        for b, j in enumerate(chunk_ids(s, n, layout)):
            if not causal or j <= i:
                pairs.append((a, b, causal and j == i))
    return pairs


def _scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool, scale: float) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale
    if diagonal:  # the same chunk of positions on both sides: key j > query i is the future
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Two partial attentions of the same queries over disjoint keys -> the attention over
    all of them: (output, log-sum-exp). The formula of the docstring above."""
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new).unsqueeze(-1)
            + block_out * torch.exp(block_lse - new).unsqueeze(-1)), new


def _post(send: torch.Tensor, dst: int, src: int, name: str):
    """Post the send of `send` to dst and the receive of a tensor like it from src."""
    recv = torch.empty_like(send)
    return recv, [dist.irecv(recv, src), comm.isend(send, dst, name)]


def _wait(works, name: str, t: int, n: int) -> None:
    for w in works:
        comm.wait(w, f"{name}: step {t + 1}/{n}: rank {dist.get_rank()} could not exchange with its ring neighbours")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        r, n = rank_and_size(group)
        right, left = global_rank(group, (r + 1) % n), global_rank(group, (r - 1) % n)
        scale = q.shape[-1] ** -0.5
        m = len(chunk_ids(r, n, layout))  # chunks per rank: 1 or 2
        c = q.shape[-2] // m
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        outs, lses, qs = out.split(c, -2), lse.split(c, -1), q.split(c, -2)
        kv = torch.stack([k, v])  # one message a step
        for t in range(n):
            s = (r - t) % n  # whose block this is
            if t < n - 1:
                nxt, works = _post(kv, right, left, "ring_attention")
            pairs = _pairs(r, s, n, layout, causal)
            record_work("ring_attention", len(pairs) * c * c)
            ks, vs = kv[0].split(c, -2), kv[1].split(c, -2)
            for a, b, diagonal in pairs:
                sc = _scores(qs[a], ks[b], diagonal, scale)
                block_lse = torch.logsumexp(sc, -1)
                block_out = torch.exp(sc - block_lse.unsqueeze(-1)) @ vs[b]
                o, l = merge(outs[a], lses[a], block_out, block_lse)
                outs[a].copy_(o)
                lses[a].copy_(l)
            if t < n - 1:
                _wait(works, "ring_attention", t, n)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout = group, causal, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout = ctx.group, ctx.causal, ctx.layout
        r, n = rank_and_size(group)
        right, left = global_rank(group, (r + 1) % n), global_rank(group, (r - 1) % n)
        scale = q.shape[-1] ** -0.5
        c = q.shape[-2] // len(chunk_ids(r, n, layout))
        dout = dout.contiguous()
        # softmax's backward needs, per query, the sum over keys of p * dp = dout . out
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        qs, dqs, douts = q.split(c, -2), dq.split(c, -2), dout.split(c, -2)
        lses, deltas = lse.split(c, -1), delta.split(c, -1)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the dK, dV of the block at hand, from every rank so far
        name = "ring_attention_backward"
        for t in range(n):
            s = (r - t) % n
            if t < n - 1:
                nxt, works = _post(kv, right, left, name)
            ks, vs = kv[0].split(c, -2), kv[1].split(c, -2)
            dks, dvs = dkv[0].split(c, -2), dkv[1].split(c, -2)
            for a, b, diagonal in _pairs(r, s, n, layout, causal):
                p = torch.exp(_scores(qs[a], ks[b], diagonal, scale) - lses[a].unsqueeze(-1))
                dvs[b].add_(p.transpose(-2, -1) @ douts[a])
                ds = p * (douts[a] @ vs[b].transpose(-2, -1) - deltas[a].unsqueeze(-1))
                dqs[a].add_(ds @ ks[b] * scale)
                dks[b].add_(ds.transpose(-2, -1) @ qs[a] * scale)
            if n > 1:  # pass dK, dV on with their block; after the N-th hop each is home
                dkv, dworks = _post(dkv, right, left, name)
                _wait(dworks, name, t, n)
            if t < n - 1:
                _wait(works, name, t, n)
                kv = nxt
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, with q, k, v of
    shape (B, H, T_local, D) as split_sequence(x, group, dim=2, layout) cut them; returns
    this rank's slice of the output. Equal to the matching slice of
    F.scaled_dot_product_attention on the whole sequence, gradients included."""
    check_slices("ring_attention", q, k, v, rank_and_size(group)[1], layout)
    return _RingAttention.apply(q, k, v, group, causal, layout)
