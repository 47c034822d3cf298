"""Muon: momentum, orthogonalised by Newton-Schulz, shared across ranks. Chapter 07
(chapters/07_muon.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --optimizer muon
    python -m minidist.bench muon
    pytest tests/test_muon.py

Muon (Jordan et al., 2024) updates each hidden weight matrix W with the momentum of its
gradient made orthogonal: M = U S V^T becomes U V^T, every singular value set to 1. The
step then moves W the same distance along every direction the gradient points in,
instead of mostly along the few directions with large singular values. Computing U V^T by
an SVD is slow on accelerators; a few matrix products are fast, so Muon runs five steps
of an odd polynomial iteration, X <- a X + b (X X^T) X + c (X X^T)^2 X, which acts on each
singular value s as p(s) = a s + b s^3 + c s^5 and leaves U and V alone. With Keller
Jordan's coefficients (3.4445, -4.7750, 2.0315) the slope at 0 is 3.4445, so small
singular values grow fast; the price is that they end in a band around 1 (about 0.7 to
1.1, chapter 07 measures it) rather than at exactly 1, which training does not mind.

Distributed: every rank holds the same averaged gradients (data parallelism), so every
rank could orthogonalise every matrix, N times the same work. Instead each matrix gets an
owner rank; only the owner keeps its momentum (1/N of the optimizer state per rank) and
runs its Newton-Schulz; the orthogonalised updates reach every rank by all-gathers, each
carrying a bucket of a few rounds' updates and started asynchronously so the next
matrices' work overlaps the transfer. Matrices are sorted by
cost and dealt out in rounds of N, one per rank, so a round's matrices are alike in size
(the work is balanced and the all-gather pads little).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T for G = U S V^T, over the last two dimensions (leading ones are
    a batch). Runs in `dtype` (bf16: fast on tensor cores and on CPUs with AMX; fp32 on
    request) and returns that dtype."""
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        X = X.mT
    batch_shape = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # (batch, m, n), m <= n
    # Frobenius norm >= spectral norm, so dividing puts every singular value in [0, 1],
    # where the polynomial is designed to work (eps guards an all-zero matrix)
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = torch.bmm(X, X.mT)  # Gram matrix, m x m (bmm: `@` on 3-D bf16 is slow on CPU)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = X.reshape(*batch_shape, *X.shape[-2:])
    return X.mT if tall else X


def adjust_lr(lr: float, shape, how: str | None = None) -> float:
    """The learning rate for a matrix of `shape` (rows = fan-out, cols = fan-in).

    "original" (None): sqrt(max(1, rows/cols)), so tall matrices are not under-updated.
    "match_rms_adamw": 0.2 * sqrt(max(rows, cols)): the update's RMS then matches a typical
    AdamW update's (about 0.2), so AdamW's learning rate and weight decay carry over
    (Liu et al., 2025, "Muon is Scalable for LLM Training")."""
    rows, cols = shape[0], shape[1]
    if how in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {how!r}")


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters, as torch.optim.Muon, spread over ranks when a process group
    of more than one rank exists (or `group` is given). `ns_dtype` is the Newton-Schulz
    precision. In a distributed run, call step() on every rank (it is a collective);
    `bucket_mb` is how many bytes of updates each all-gather carries (at least one round)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 ns_dtype: torch.dtype = torch.bfloat16, group=None, bucket_mb: float = 4.0):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"need lr >= 0, 0 <= momentum < 1, weight_decay >= 0, ns_steps >= 1; "
                             f"got {lr}, {momentum}, {weight_decay}, {ns_steps}")
        adjust_lr(1.0, (1, 1), adjust_lr_fn)  # rejects an unknown name now, not at step 1
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon is for 2-D weight matrices; got a parameter of shape "
                                     f"{tuple(p.shape)}: give it to AdamW (see muon.split_params)")
        self.ns_dtype, self.group, self.bucket_mb = ns_dtype, group, bucket_mb

    def _world(self) -> tuple[int, int]:
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _update(self, p: torch.Tensor, g: dict) -> torch.Tensor:
        """Momentum (an exponential moving average of gradients; Nesterov looks one step
        ahead), then its orthogonalisation. Only the owner of p runs this."""
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - g["momentum"])  # buf = m buf + (1 - m) grad
        m = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        return newton_schulz(m, g["ns_steps"], self.ns_dtype)

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, g: dict) -> None:
        p.mul_(1 - g["lr"] * g["weight_decay"])  # decoupled weight decay
        p.add_(update.view_as(p), alpha=-adjust_lr(g["lr"], p.shape, g["adjust_lr_fn"]))

    @staticmethod
    def _deal(items: list) -> list[int]:
        """The matrices dealt out by cost, largest first, N per round: rank r owns the r-th
        of each round. Newton-Schulz on an m x n matrix (m <= n) costs about m*m*n."""
        cost = lambda i: min(items[i][0].shape) ** 2 * max(items[i][0].shape)
        return sorted(range(len(items)), key=lambda i: (-cost(i), i))

    def owners(self) -> dict[int, int]:
        """id(parameter) -> the rank that keeps its momentum and orthogonalises it."""
        _, world = self._world()
        items = [(p, g) for g in self.param_groups for p in g["params"]]
        return {id(items[i][0]): j % world for j, i in enumerate(self._deal(items))}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rank, world = self._world()
        items = [(p, g) for g in self.param_groups for p in g["params"]]
        if world == 1:
            for p, g in items:
                if p.grad is not None:
                    self._apply(p, self._update(p, g), g)
            return loss
        order = self._deal(items)
        # Each round gives every rank one slot: [has_update, update (flattened), padding].
        # Rounds are packed into buckets of about bucket_mb, one asynchronous all-gather
        # per bucket: few collectives (each has a fixed latency), and the next bucket's
        # Newton-Schulz runs while the last one's all-gather is on the wire.
        pending, slots, parts = [], [], []
        device = items[0][0].device

        def flush():
            send = torch.cat(parts)
            recv = torch.empty(world * send.numel(), dtype=send.dtype, device=device)
            work = dist.all_gather_single(recv, send, group=self.group, async_op=True)
            pending.append((list(slots), recv.view(world, -1), work))
            slots.clear(), parts.clear()

        for start in range(0, len(order), world):
            round_ = order[start:start + world]
            send = torch.zeros(1 + max(items[i][0].numel() for i in round_), dtype=self.ns_dtype,
                               device=device)
            if rank < len(round_):
                p, g = items[round_[rank]]
                if p.grad is not None:  # no gradient: the owner still joins, sending "none"
                    send[0] = 1
                    send[1:1 + p.numel()] = self._update(p, g).flatten()
            slots.append((round_, sum(t.numel() for t in parts), send.numel()))
            parts.append(send)
            if sum(t.numel() * t.element_size() for t in parts) >= self.bucket_mb * 2**20:
                flush()
        if parts:
            flush()
        for bucket, recv, work in pending:
            work.wait()
            for round_, offset, size in bucket:
                for owner, i in enumerate(round_):  # rank `owner` computed matrix i
                    buf, (p, g) = recv[owner, offset:offset + size], items[i]
                    if buf[0] == 1:
                        self._apply(p, buf[1:1 + p.numel()], g)
        return loss


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's): hidden 2-D weight matrices go to Muon; embeddings,
    the output head (tied to the token embedding in minidist's GPT), LayerNorm gains and
    biases go to AdamW. An embedding is a lookup table, not a linear map acting on its
    input, so orthogonalising its update has no meaning; the head's rows each meet one
    token's loss, and the Muon authors found AdamW better for both."""
    not_hidden = set()
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            not_hidden |= {id(p) for p in mod.parameters()}
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        not_hidden |= {id(p) for p in head.parameters()}
    muon, other, seen = [], [], set()
    for p in model.parameters():  # each parameter once, even when tied
        if id(p) in seen:
            continue
        seen.add(id(p))
        (muon if p.dim() == 2 and id(p) not in not_hidden else other).append(p)
    return muon, other
