"""Muon in its plain form: Newton-Schulz, the Muon step, and distributed Muon one round at a
time, in few lines on torch.distributed. Chapter 07 (chapters/07_muon.md). Exercised by:

    pytest tests/test_simple_forms.py     # equal, to the bit, to minidist.muon's Muon and newton_schulz

Muon updates each hidden weight matrix W with the momentum of its gradient made
orthogonal: M = U S V^T becomes (nearly) U V^T, so the step moves W as far along every
direction the gradient points in. Newton-Schulz gets there with matrix products only.

Distributed: every rank holds the same averaged gradients, so each matrix gets an owner
instead of being orthogonalised N times. The matrices are dealt out by cost, largest
first, N per round; rank r owns the r-th of each round, keeps its momentum (1/N of the
state) and computes its update; then one all-gather per round hands every rank every
update, as [flag, update, padding] (flag 0: no gradient, or no matrix left for this rank).
minidist/muon/optimizer.py's Muon is the same arithmetic, rounds packed into buckets.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["newton_schulz", "PlainMuon"]


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T for the matrix G = U S V^T: X <- a X + (b A + c A^2) X, A = X X^T,
    acts on each singular value s as a s + b s^3 + c s^5, pushing it towards 1."""
    a, b, c = 3.4445, -4.7750, 2.0315  # Keller Jordan's quintic, as torch.optim.Muon
    X = G.to(dtype)
    tall = X.size(0) > X.size(1)
    if tall:  # iterate on the wide side, X X^T then the smaller matrix (laid out anew, as
        X = X.T.contiguous()  # minidist's batched chain: in fp32 the layout sets the rounding)
    X = X / X.norm().clamp(min=eps)  # Frobenius >= spectral norm: singular values in [0, 1]
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A A (fused, as torch's Muon)
        X = torch.addmm(X, B, X, beta=a)  # a X + B X
    return X.T if tall else X


def check_hyperparameters(lr: float, momentum: float, weight_decay: float, ns_steps: int) -> None:
    """Refuse what no step could use (nan passes every comparison, so each bound is spelled)."""
    if not (0 <= lr < math.inf and 0 <= momentum < 1 and 0 <= weight_decay < math.inf) or ns_steps < 1:
        raise ValueError(f"need a finite lr >= 0, 0 <= momentum < 1, a finite weight_decay >= 0, ns_steps >= 1; "
                         f"got {lr}, {momentum}, {weight_decay}, {ns_steps}")


class PlainMuon(torch.optim.Optimizer):
    """Muon for 2-D parameters, one round of N matrices at a time over the ranks of `group`
    (the default group if one exists; one process otherwise). Call step() on every rank."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5, ns_dtype: torch.dtype = torch.bfloat16,
                 group=None):
        check_hyperparameters(lr, momentum, weight_decay, ns_steps)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      weight_decay=weight_decay, ns_steps=ns_steps))
        self.ns_dtype, self.group = ns_dtype, group

    def update(self, p: torch.Tensor, g: dict) -> torch.Tensor:
        """The owner's work: momentum (Nesterov looks one step ahead), then Newton-Schulz."""
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - g["momentum"])  # buf = m buf + (1 - m) grad
        M = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        return newton_schulz(M, g["ns_steps"], self.ns_dtype)

    @torch.no_grad()
    def step(self) -> None:
        distributed = self.group is not None or (dist.is_available() and dist.is_initialized())
        rank, world = (dist.get_rank(self.group), dist.get_world_size(self.group)) if distributed else (0, 1)
        items = [(p, g) for g in self.param_groups for p in g["params"]]
        # Newton-Schulz on an m x n matrix (m <= n) costs about m*m*n: largest first, so a
        # round's matrices are alike and its ranks finish together (ties: in order)
        order = sorted(range(len(items)), key=lambda i: -min(items[i][0].shape) ** 2 * max(items[i][0].shape))
        for start in range(0, len(order), world):
            round_ = order[start:start + world]
            send = torch.zeros(1 + max(items[i][0].numel() for i in round_), dtype=self.ns_dtype,
                               device=items[0][0].device)
            if rank < len(round_) and items[round_[rank]][0].grad is not None:
                update = self.update(*items[round_[rank]]).flatten()
                send[0], send[1:1 + update.numel()] = 1, update
            recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
            if world > 1:
                dist.all_gather_single(recv, send, group=self.group)
            else:
                recv.copy_(send)
            recv = recv.view(world, -1)  # row r: rank r's [flag, update, padding]
            for owner, i in enumerate(round_):  # every rank applies every update, in one order
                if recv[owner, 0] == 1:
                    p, g = items[i]
                    p.mul_(1 - g["lr"] * g["weight_decay"])  # decoupled weight decay
                    scale = math.sqrt(max(1.0, p.size(0) / p.size(1)))  # tall matrices: a larger step
                    p.add_(recv[owner, 1:1 + p.numel()].view_as(p), alpha=-g["lr"] * scale)
