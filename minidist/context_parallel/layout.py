"""Who holds which tokens: the sequence cut into slices, one per rank of the cp group.
Chapter 12 (chapters/12_context_parallel.md). Exercised by tests/test_context_parallel.py.

contiguous: the sequence in N equal chunks, rank r holds chunk r. With a causal mask the
last rank's queries see the whole sequence and the first rank's only their own chunk.
zigzag: the sequence in 2N chunks, rank r holds chunks r and 2N-1-r (one early, one
late), so every rank has the same amount of causal work (work.py counts it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm

LAYOUTS = ("contiguous", "zigzag")


def rank_and_size(group) -> tuple[int, int]:
    """This rank's place in `group` (None: the world) and the group's size."""
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, r: int) -> int:
    """Rank r of `group` as the world knows it: messages are addressed by global rank."""
    return r if group is None else dist.get_global_rank(group, r)


def n_chunks(n: int, layout: str, who: str = "context_parallel") -> int:
    """How many chunks the whole sequence is cut into for n ranks."""
    if layout not in LAYOUTS:
        raise ValueError(f"{who}: layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return n if layout == "contiguous" else 2 * n


def check_length(T: int, n: int, layout: str, who: str) -> None:
    """Refuse a sequence the layout cannot cut into equal chunks, saying what to use."""
    c = n_chunks(n, layout, who)
    if T % c:
        other = ("; or layout='contiguous' (needs a multiple of N)" if layout == "zigzag" else "")
        raise ValueError(f"{who}: a sequence of {T} tokens does not cut into {c} equal chunks "
                         f"({layout} over {n} ranks cuts {'2N' if layout == 'zigzag' else 'N'}): "
                         f"pad it to a multiple of {c}{other}")


def check_slices(who: str, q, k, v, n: int, layout: str) -> None:
    """Refuse q, k, v that are not (B, H, T_local, D) slices as split_sequence cuts them."""
    n_chunks(n, layout, who)  # a known layout
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"{who}: q, k, v must have one shape (B, H, T_local, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"{who}: q, k, v must be floating point of one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}: cast them (e.g. .float()) before attention")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"{who}: zigzag needs an even T_local (the sequence in 2N = {2 * n} chunks), "
                         f"got {q.shape[2]}: pad the sequence to a multiple of {2 * n} and cut it with "
                         f"split_sequence(..., layout='zigzag'), or use layout='contiguous'")


def chunk_ids(rank: int, n: int, layout: str) -> list[int]:
    """The chunks of the whole sequence that `rank` holds, in the order it holds them."""
    return [rank] if n_chunks(n, layout) == n else [rank, 2 * n - 1 - rank]


def positions(T: int, rank: int, n: int, layout: str) -> torch.Tensor:
    """The true positions (0..T-1) of the tokens `rank` holds, in its order: what the
    position embedding and the causal mask of those tokens must use."""
    check_length(T, n, layout, "positions")
    c = T // n_chunks(n, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, n, layout)])


def split_sequence(x: torch.Tensor, group, dim: int, layout: str = "contiguous") -> torch.Tensor:
    """This rank's slice of x (the whole sequence along `dim`, the same on every rank):
    chunk r (contiguous) or chunks r and 2N-1-r (zigzag). Differentiable (an index)."""
    r, n = rank_and_size(group)
    check_length(x.shape[dim], n, layout, "split_sequence")
    return x.index_select(dim, positions(x.shape[dim], r, n, layout).to(x.device))


def gather_blocks(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's x (all the same shape), by rank: an all-gather made of minidist's
    all-to-all (each rank sends the same block to every other), so it runs on any group.
    Each rank sends (N-1) times its x."""
    _, n = rank_and_size(group)
    x = x.contiguous()
    out = x.new_empty((n, *x.shape))
    comm.all_to_all(out, x.unsqueeze(0).expand(n, *x.shape), group=group)  # a view: no copies
    return list(out.unbind(0))


def gather_sequence(x: torch.Tensor, group, dim: int, layout: str = "contiguous") -> torch.Tensor:
    """The inverse of split_sequence: the whole sequence along `dim`, in true order, on
    every rank (not differentiable: for checking and for outputs)."""
    _, n = rank_and_size(group)
    dim = dim % x.dim()
    T = x.shape[dim] * n
    full = x.new_empty((*x.shape[:dim], T, *x.shape[dim + 1:]))
    for s, part in enumerate(gather_blocks(x.detach(), group)):
        full.index_copy_(dim, positions(T, s, n, layout).to(x.device), part)
    return full
