"""Muon under ZeRO stages 1 and 2. Chapter 07 (chapters/07_muon.md), section "Muon under
ZeRO". Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --optimizer muon --zero-stage 2
    pytest tests/test_muon_zero.py

AdamW's parameters (embeddings, head, gains, biases) live in ZeRO's flat shards as without
Muon. Muon's matrices stay outside ZeRO's units, whole and replicated (stages 1 and 2 keep
every parameter whole on every rank anyway): Newton-Schulz needs a whole matrix, and a flat
shard cuts matrices anywhere. Each matrix has an owner rank (minidist.muon.Muon.owners).

The gradients reach the owners by an owner-aligned reduce-scatter: the matrices, dealt out
largest first, make rounds of one matrix per rank; each round is one slot per rank, as
long as the round's largest matrix plus a flag, and rank r's part of the buffer holds, in
each round's slot, the gradient of the matrix rank r owns. A reduce-scatter that averages
then leaves every rank exactly its own matrices' averaged gradients: the bytes of ZeRO's
reduce-scatter, Psi_muon (N - 1) / N. The other ranks' copies are freed at once (at stage 1
too: nothing needs them). The owner computes momentum and Newton-Schulz, and Muon's own
all-gather per bucket of rounds hands every rank the updates (minidist/muon.py): Psi_muon
(N - 1) / N more, so 2 Psi (N - 1) / N in all, as AdamW under ZeRO. (The updates travel in
Muon's Newton-Schulz precision, bf16 by default: half the bytes of an fp32 all-gather.)

MuonUnderZero is the one gradient-sync object of such a run (minidist/ddp.py's interface):
no_sync() lets Muon's gradients accumulate whole until the last micro-step, so they cross
the wire once per step; finish_gradient_synchronization() finishes ZeRO's reduce-scatters
and then runs Muon's; clip_grad_norm_() clips by the norm of the whole averaged gradient,
ZeRO's shards and the owners' matrices, squares summed across ranks. After it the loss
scaler's unscale_(muon) sees the owners' averaged gradients (and its MAX across ranks tells
every rank about an overflow only an owner can see).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from minidist.muon import Muon, _plan

__all__ = ["MuonUnderZero", "reduce_to_owners"]


@torch.no_grad()
def reduce_to_owners(muon: Muon) -> None:
    """Average the gradients of Muon's matrices across ranks, leaving each averaged gradient
    only on the matrix's owner (its .grad; None on every other rank). A collective: every
    rank calls it with the same Muon."""
    rank, world = muon._world()
    items = [(p, g) for g in muon.param_groups for p in g["params"]]
    if not items:
        return
    dtype, device = items[0][0].dtype, items[0][0].device
    pending = []
    # the same rounds as Muon's step (ownership is a round's position); buckets of about
    # bucket_mb per rank's part, so that a few collectives carry everything
    for bucket in _plan(items, muon._deal(items), world, muon.bucket_mb * 2**20, dtype):
        grads = {i: items[i][0].grad for round_ in bucket.rounds for i in round_
                 if items[i][0].grad is not None}
        # row r: the gradients of the matrices rank r owns, each in its round's slot
        send = torch.stack([bucket.pack(r, grads, dtype, device) for r in range(world)])
        for round_ in bucket.rounds:
            for i in round_:
                items[i][0].grad = None  # this rank's copies are in `send` now
        recv = torch.empty(bucket.numel, dtype=dtype, device=device)
        work = dist.reduce_scatter_single(recv, send.view(-1), op=dist.ReduceOp.AVG,
                                          group=muon.group, async_op=True)
        pending.append((bucket, recv, work))
    for bucket, recv, work in pending:
        work.wait()
        flags = recv[[offset for offset, _ in bucket.slots]].tolist()  # one read per bucket
        for round_, (offset, _), flag in zip(bucket.rounds, bucket.slots, flags):
            if rank < len(round_) and flag > 0:  # some rank had a gradient for it
                p = items[round_[rank]][0]
                p.grad = recv[offset + 1:offset + 1 + p.numel()].view_as(p)


class MuonUnderZero:
    """The gradient-sync interface (no_sync, finish_gradient_synchronization,
    clip_grad_norm_) of a ZeRO optimizer at stage 1 or 2 beside a Muon that holds the
    hidden matrices; see the module docstring. It also makes muon.step() finish the
    synchronisation first, so Muon never steps on gradients that were not averaged."""

    def __init__(self, zero, muon: Muon):
        if getattr(zero, "stage", None) not in (1, 2):
            raise ValueError("MuonUnderZero is for ZeRO stages 1 and 2 (their parameters are "
                             "whole on every rank); Muon under ZeRO-3 is not built yet")
        self.zero, self.muon = zero, muon
        self._fresh = False  # a Muon gradient arrived since the last reduction
        for g in muon.param_groups:
            for p in g["params"]:
                p.register_post_accumulate_grad_hook(self._on_grad)
        muon.before_step = self.finish_gradient_synchronization

    def _on_grad(self, p) -> None:
        self._fresh = True

    @contextlib.contextmanager
    def no_sync(self):
        """ZeRO's no_sync; Muon's gradients simply accumulate, whole, until the reduction."""
        with self.zero.no_sync():
            yield

    def finish_gradient_synchronization(self) -> None:
        """ZeRO's shards complete, then Muon's gradients averaged onto their owners (once per
        step: calling it again is a no-op until backward produces new gradients)."""
        self.zero.finish_gradient_synchronization()
        if self._fresh:
            self._fresh = False
            reduce_to_owners(self.muon)

    def _muon_grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.muon.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the whole averaged gradient: the squares of ZeRO's
        shards and of the matrices this rank owns, summed across ranks (each element is
        held by exactly one rank)."""
        self.finish_gradient_synchronization()
        sq = self.zero._grad_square_sum() + sum(g.double().square().sum() for g in self._muon_grads())
        sq = torch.as_tensor(sq, dtype=torch.float64).reshape(1)
        dist.all_reduce(sq, group=self.zero.group)
        norm = sq.sqrt().float()[0]
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        self.zero._scale_grads(scale)
        for g in self._muon_grads():
            g.mul_(scale)
        return norm

    def state_bytes(self) -> dict:
        """Optimizer state this rank holds: Muon's momentum of the matrices it owns, and
        AdamW's moments of ZeRO's shards."""
        nbytes = lambda st: sum(v.numel() * v.element_size() for s in st.values()
                                for v in s.values() if torch.is_tensor(v))
        return {"muon": nbytes(self.muon.state), "adamw": nbytes(self.zero.optim.state)}
