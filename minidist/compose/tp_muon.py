"""Muon on tensor-parallel matrices: why orthogonalising each shard alone is wrong, and two
ways that are right. Chapter 10 (chapters/10_tensor_parallel.md), section "Muon on
shards", derives all of it. Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --tp 2    (CPU default: Muon)
    pytest -q tests/test_tensor_parallel_muon.py

t shards orthogonalised alone are t orthogonal blocks side by side, about sqrt(t) too large
(method="shardwise", the bug kept to be measured). (a) "gather": all-gather the shards,
orthogonalise the whole as one process would, keep this rank's slice. (b) "shards":
Newton-Schulz needs only the Gram on the uncut side, a sum of per-shard Grams (one k x k
all-reduce per step). Muon's own group is the dp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.muon import Muon, adjust_lr
from minidist.muon.orthogonalize import newton_schulz, newton_schulz_many, schedule
from minidist.tensor_parallel import shard_of

__all__ = ["shardwise_error", "ShardLayout", "newton_schulz_sharded", "TensorParallelMuon",
           "tensor_parallel_group", "comm_bytes", "METHODS"]

METHODS = ("gather", "shards", "shardwise")  # the last one is the bug, for measuring


def shardwise_error(G: torch.Tensor, t: int, dim: int = 0, steps: int = 5,
                    dtype: torch.dtype = torch.float32) -> dict:
    """One process, no group: G cut in t equal shards along `dim` (0: a column-parallel
    weight, 1: a row-parallel one), each orthogonalised alone and put side by side,
    against G's own orthogonalisation: {"rel_diff", "cosine", "norm_ratio"}."""
    ref = newton_schulz(G, steps, dtype).float().flatten()
    x = torch.cat([newton_schulz(s, steps, dtype) for s in G.chunk(t, dim)], dim).float().flatten()
    return {"rel_diff": ((x - ref).norm() / ref.norm()).item(), "cosine": F.cosine_similarity(x, ref, 0).item(),
            "norm_ratio": (x.norm() / ref.norm()).item()}


# ------------------------------------------------------------------ (a) gather the whole matrix

class ShardLayout:
    """Where every tp rank's shard of one matrix lies in the full matrix: the (dim, ranges)
    of each rank (tensor_parallel_gpt.shard_spec's entries), checked to tile the matrix
    with shards of one shape (all_gather needs that; Megatron's splits of heads and of the
    hidden width are even)."""

    def __init__(self, specs: list, shard_shape: tuple[int, int]):
        self.dim, self.ranges = specs[0][0], [tuple(tuple(r) for r in s[1]) for s in specs]
        spans = sorted(r for ranges in self.ranges for r in ranges)
        size = spans[-1][1]
        widths = {sum(b - a for a, b in ranges) for ranges in self.ranges}
        if any(s[0] != self.dim for s in specs) or len(widths) != 1 or \
                [a for a, _ in spans] != [0] + [b for _, b in spans[:-1]]:
            raise ValueError(f"the shards of a {shard_shape} matrix do not tile it evenly along one "
                             f"dimension ({specs}): tensor-parallel Muon needs equal shards")
        self.shard_shape = tuple(shard_shape)
        self.full_shape = tuple(size if d == self.dim else n for d, n in enumerate(shard_shape))

    @property
    def key(self) -> tuple:
        """Equal for matrices cut alike (every block's c_fc, say): they travel together."""
        return self.dim, tuple(self.ranges), self.shard_shape

    def gather(self, X: torch.Tensor, group) -> torch.Tensor:
        """This rank's shard X (or a stack of shards cut alike, leading dims) -> the full
        matrix (matrices), every rank's pieces in their places: one all-gather."""
        t, d = len(self.ranges), self.dim - 2  # d: the cut dimension, counted from the end
        parts = X.new_empty(t * X.numel())
        dist.all_gather_single(parts, X.contiguous().view(-1), group=group)
        parts = parts.view(t, *X.shape)
        full = X.new_empty(X.shape[:-2] + self.full_shape)
        for r, ranges in enumerate(self.ranges):
            offset = 0
            for a, b in ranges:  # c_attn: this rank's q rows, then its k rows, then its v rows
                full.narrow(d, a, b - a).copy_(parts[r].narrow(d, offset, b - a))
                offset += b - a
        return full

    def mine(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        return shard_of(full, (self.dim - 2, self.ranges[rank]))


# ------------------------------------------------------------------ (b) Newton-Schulz on the shards

def newton_schulz_sharded(G: torch.Tensor, dim: int, group, steps: int = 5,
                          dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7,
                          coefficients="jordan") -> torch.Tensor:
    """This rank's slice of newton_schulz(the full matrix), from this rank's shard G (or a
    batch of shards, leading dims, all cut alike) cut along `dim` (0 rows, 1 columns).
    Per step one all-reduce of the small Gram matrix on the uncut side; the norm, one
    more (of one number per matrix). Every rank of `group` calls it with its shards."""
    coefs, margin = schedule(coefficients, steps)
    X = G.to(dtype)
    if dim % 2 == 0:  # cut by rows: X^T is cut by columns; its Gram X^T X is on the uncut side
        X = X.mT
    batch_shape = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # (batch, k, n/t): each matrix cut along its columns
    # ||X||_F^2 = sum over ranks of the shards' squares (fp32, as X.norm() accumulates)
    sq = X.float().square().sum(dim=(-2, -1), keepdim=True)
    dist.all_reduce(sq, group=group)
    norm = sq.sqrt().to(dtype)
    X = X / (norm if margin == 1.0 else norm * margin).clamp(min=eps)
    for a, b, c in coefs:
        A = torch.bmm(X.float(), X.float().mT)  # this shard's part of X X^T, k x k, fp32
        dist.all_reduce(A, group=group)  # the whole Gram, rounded once to dtype below
        A = A.to(dtype)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2: the same on every rank
        X = torch.baddbmm(X, B, X, beta=a)  # a X_r + B X_r: this rank's columns, no talking
    X = X.reshape(*batch_shape, *X.shape[-2:])
    return X.mT if dim % 2 == 0 else X


# ------------------------------------------------------------------ the optimizer

def tensor_parallel_group(model) -> object | None:
    """The tp group of a model that tensor_parallel_gpt.parallelize split (its shards carry
    `tp_shard`; ParallelGPT, and a pipeline stage cut from one, keep the group as
    .tp_group), None for a whole model."""
    split = any(getattr(p, "tp_shard", None) is not None for p in model.parameters())
    return getattr(model, "tp_group", None) if split else None


class TensorParallelMuon(Muon):
    """minidist.muon.Muon for shards of tensor-parallel matrices (params carry `tp_shard`):
    `method` one of METHODS, `group` the dp group (Muon's owners). Momentum is elementwise, so
    only the orthogonalisation and the lr's shape adjustment (the full matrix's) change.
    Building it is a collective over the tp group (each rank learns where the shards lie)."""

    def __init__(self, params, tp_group, method: str = "gather", **kwargs):
        super().__init__(params, **kwargs)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.tp_group, self.method = tp_group, method
        self.tp_rank, self.tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        mats = [p for p, _ in self.matrices()]
        specs = [getattr(p, "tp_shard", None) for p in mats]
        everyone = [None] * self.tp
        dist.all_gather_object(everyone, specs, group=tp_group)
        # id(p) -> its layout; None: a replicated matrix, whole on every tp rank
        self.layouts = {id(p): None if specs[i] is None else
                        ShardLayout([everyone[r][i] for r in range(self.tp)], p.shape)
                        for i, p in enumerate(mats)}

    def full_shape(self, p: torch.Tensor) -> tuple[int, int]:
        layout = self.layouts[id(p)]
        return tuple(p.shape) if layout is None else layout.full_shape

    def _apply(self, p: torch.Tensor, update: torch.Tensor, g: dict) -> None:
        p.mul_(1 - g["lr"] * g["weight_decay"])  # as Muon's, with the whole matrix's shape
        p.add_(update.view_as(p), alpha=-adjust_lr(g["lr"], self.full_shape(p), g["adjust_lr_fn"]))

    def _updates(self, pairs: list) -> list[torch.Tensor]:
        """This rank's slices of the updates of [(p, group)], the matrices this rank owns
        (every tp rank of a replica owns the same ones, so the calls below pair up)."""
        out: list = [None] * len(pairs)
        for (steps, coefficients), ks in _by_settings(pairs).items():
            momenta = [self._momentum(*pairs[k]).to(self.ns_dtype) for k in ks]
            layouts = [self.layouts[id(pairs[k][0])] for k in ks]
            for k, O in zip(ks, self._orthogonalise(momenta, layouts, steps, coefficients)):
                out[k] = O
        return out

    def _orthogonalise(self, momenta, layouts, steps, coefficients) -> list[torch.Tensor]:
        ns = dict(steps=steps, dtype=self.ns_dtype, coefficients=coefficients)
        if self.method == "shardwise" or self.tp == 1:  # (the bug at tp > 1: each shard alone)
            return newton_schulz_many(momenta, **ns)
        alike: dict = {}  # shards cut alike (every block's c_fc, say) travel as one stack
        for i, L in enumerate(layouts):
            alike.setdefault(None if L is None else L.key, []).append(i)
        out = list(momenta)
        for key, idx in alike.items():
            if key is None:  # replicated: whole on every rank, orthogonalised as one process would
                for i, O in zip(idx, newton_schulz_many([momenta[i] for i in idx], **ns)):
                    out[i] = O
                continue
            stack, L = torch.stack([momenta[i] for i in idx]), layouts[idx[0]]
            if self.method == "gather":  # (a): the whole matrices (one all-gather), then mine
                whole = L.gather(stack, self.tp_group).unbind(0)
                result = [L.mine(O, self.tp_rank) for O in newton_schulz_many(list(whole), **ns)]
            else:  # (b): one chain, one all-reduce per Newton-Schulz step, for the stack
                result = newton_schulz_sharded(stack, L.dim, self.tp_group, **ns).unbind(0)
            for i, O in zip(idx, result):
                out[i] = O
        return out


def _by_settings(pairs: list) -> dict:
    """{(ns_steps, coefficients): [indices of pairs]}: matrices that share Newton-Schulz settings."""
    same: dict = {}
    for k, (_, g) in enumerate(pairs):
        c = g["ns_coefficients"]
        same.setdefault((g["ns_steps"], c if isinstance(c, str) else tuple(c)), []).append(k)
    return same


# ------------------------------------------------------------------ bytes

def comm_bytes(full_shapes, t: int, method: str, ns_steps: int = 5,
               ns_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes one step of TensorParallelMuon hands to the tp group's collectives on each rank
    for matrices of `full_shapes` ((a): m n in ns_dtype each; (b): ns_steps k^2 + 1 fp32,
    k = min(m, n)), and "sent", what a ring puts on the wire from each rank."""
    out = {"all_gather": 0, "all_reduce": 0}
    if t > 1 and method == "gather":
        out["all_gather"] = sum(m * n for m, n in full_shapes) * ns_dtype.itemsize
    elif t > 1 and method == "shards":
        out["all_reduce"] = sum(ns_steps * min(m, n) ** 2 + 1 for m, n in full_shapes) * 4
    out["sent"] = (t - 1) / t * (out["all_gather"] + 2 * out["all_reduce"])
    return out
