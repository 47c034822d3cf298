"""Muon under ZeRO stages 1, 2 and 3. Chapter 07 (chapters/07_muon.md), section "Muon
under ZeRO" (bytes: its section 7 and appendix H, minidist.cost_model.muon_comm_volume).
Exercised by

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --optimizer muon --zero-stage 3
    pytest tests/test_muon_zero.py

AdamW's parameters live in ZeRO's flat shards; Muon's matrices stay outside ZeRO's units,
because Newton-Schulz needs a whole matrix and a flat shard cuts matrices anywhere. Their
gradients reach each matrix's owner by an owner-aligned reduce-scatter (rounds of one matrix
per rank, one slot each); at stage 3 the ZeRO-3 optimizer shards and gathers them, and
ShardedMuon sends each piece of an update, owner to holder, in one all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.muon import Muon, RoundBucket, adjust_lr, plan_buckets
from minidist.sync import GradientSync

__all__ = ["muon_for_zero", "muon_under_zero", "MuonUnderZero", "MuonUnderZero3", "ShardedMuon",
           "reduce_to_owners"]


def muon_for_zero(zero, params, **kwargs) -> Muon:
    """The Muon for `params` beside the ZeRO optimizer `zero`: a Muon at stages 1-2 (its
    matrices whole on every rank), a ShardedMuon at stage 3 (zero built with others=params)."""
    return ShardedMuon(params, zero, **kwargs) if zero.shards_parameters else Muon(params, **kwargs)


def muon_under_zero(zero, muon: Muon):
    """The gradient sync of a run with Muon beside the ZeRO optimizer `zero`."""
    return (MuonUnderZero3 if zero.shards_parameters else MuonUnderZero)(zero, muon)


def _send_to_owners(muon: Muon, items: list, bucket: RoundBucket):
    """Start one bucket's owner-aligned reduce-scatter (row r of what is sent: the
    gradients of the matrices rank r owns, each in its round's slot); this rank's copies
    of the gradients are dropped (they are in the buffer now). Returns (recv, work)."""
    _, world = muon.rank_and_world()
    dtype, device = items[0][0].dtype, items[0][0].device
    grads = {i: items[i][0].grad for round_ in bucket.rounds for i in round_
             if items[i][0].grad is not None}
    send = torch.stack([bucket.pack(r, grads, dtype, device) for r in range(world)])
    for round_ in bucket.rounds:
        for i in round_:
            items[i][0].grad = None
    recv = torch.empty(bucket.numel, dtype=dtype, device=device)
    work = dist.reduce_scatter_single(recv, send.view(-1), op=dist.ReduceOp.AVG,
                                      group=muon.group, async_op=True)
    return recv, work


def _owned(bucket: RoundBucket, recv: torch.Tensor, rank: int, items: list):
    """(parameter, averaged gradient) for each matrix of the bucket this rank owns that
    some rank had a gradient for (its slot's flag, averaged, is above zero)."""
    flags = recv[[offset for offset, _ in bucket.slots]].tolist()  # one read per bucket
    for round_, (offset, _), flag in zip(bucket.rounds, bucket.slots, flags):
        if rank < len(round_) and flag > 0:
            p = items[round_[rank]][0]
            yield p, recv[offset + 1:offset + 1 + p.numel()].view_as(p)


@torch.no_grad()
def reduce_to_owners(muon: Muon) -> None:
    """Average the gradients of Muon's matrices across ranks, leaving each averaged gradient
    only on the matrix's owner (its .grad; None on every other rank). A collective: every
    rank calls it with the same Muon."""
    rank, world = muon.rank_and_world()
    items = muon.matrices()
    if not items:
        return
    # the same rounds as Muon's step (ownership is a round's position); buckets of about
    # bucket_mb per rank's part, so that a few collectives carry everything
    buckets = plan_buckets(items, Muon.deal(items), world, muon.bucket_mb * 2**20, items[0][0].dtype)
    pending = [(bucket, *_send_to_owners(muon, items, bucket)) for bucket in buckets]
    for bucket, recv, work in pending:
        work.wait()
        for p, grad in _owned(bucket, recv, rank, items):
            p.grad = grad


class MuonUnderZero(GradientSync):
    """The gradient sync of a ZeRO optimizer at stage 1 or 2 beside a Muon that holds the
    hidden matrices (see the module docstring): Muon steps on the owners' averaged gradients."""

    def __init__(self, zero, muon: Muon):
        if zero.shards_parameters:
            raise ValueError("MuonUnderZero is for ZeRO stages 1 and 2 (their parameters are "
                             "whole on every rank); at stage 3 use MuonUnderZero3")
        self.zero, self.muon = zero, muon
        self._fresh = False  # a Muon gradient arrived since the last reduction
        for p, _ in muon.matrices():
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p) -> None:
        self._fresh = True

    def no_sync(self):
        """ZeRO's no_sync; Muon's gradients accumulate whole until the reduction (at stage 3
        ZeRO's is a no-op: every micro-step reduces, and the owners' sums add up)."""
        return self.zero.no_sync()

    def finish_gradient_synchronization(self) -> None:
        """ZeRO's shards complete, then Muon's gradients averaged onto their owners (once per
        step: calling it again is a no-op until backward produces new gradients)."""
        self.zero.finish_gradient_synchronization()
        if self._fresh:
            self._fresh = False
            reduce_to_owners(self.muon)

    def _muon_grads(self) -> list:
        return [(p, p.grad) for g in self.muon.param_groups for p in g["params"] if p.grad is not None]

    def grad_square_sum(self, weight=None) -> torch.Tensor:
        """The squares of ZeRO's shards and of the matrices this rank owns, summed across
        ranks (each element is held by exactly one rank)."""
        sq = self.zero.local_grad_square_sum(weight) + sum(
            (1.0 if weight is None else weight(p)) * grad.double().square().sum() for p, grad in self._muon_grads())
        sq = torch.as_tensor(sq, dtype=torch.float64).reshape(1)
        dist.all_reduce(sq, group=self.zero.group)
        return sq[0]

    def scale_grads(self, coef) -> None:
        self.zero.scale_grads(coef)
        for _, grad in self._muon_grads():
            grad.mul_(coef)

    def state_bytes(self) -> dict:
        """Optimizer state this rank holds: Muon's momentum of the matrices it owns, and
        AdamW's moments of ZeRO's shards."""
        muon = sum(v.numel() * v.element_size() for s in self.muon.state.values()
                   for v in s.values() if torch.is_tensor(v))
        return {"muon": muon, "adamw": self.zero.optimizer_state_bytes()}


class MuonUnderZero3(MuonUnderZero):
    """Muon beside ZeRO-3 (see the module docstring): `zero` a FullyShardedOptimizer built
    with others=Muon's matrices, `muon` a ShardedMuon (muon_for_zero builds both). A
    matrix's full-size gradient lives until its bucket is reduce-scattered."""

    def __init__(self, zero, muon: Muon):
        if not zero.shards_parameters:
            raise ValueError("MuonUnderZero3 is for ZeRO stage 3; at stages 1-2 use MuonUnderZero")
        if not isinstance(muon, ShardedMuon):
            raise TypeError("at ZeRO stage 3 Muon must be a ShardedMuon: build it with "
                            "minidist.compose.zero_muon.muon_for_zero(zero, params, ...)")
        self.items = muon.matrices()
        self.zero, self.muon = zero, muon
        self.rank, world = muon.rank_and_world()
        self.buckets = plan_buckets(self.items, Muon.deal(self.items), world, muon.bucket_mb * 2**20,
                                    self.items[0][0].dtype)
        self.bucket_of = {self.items[i][0]: b for b in self.buckets for r in b.rounds for i in r}
        self.ready = {b: 0 for b in self.buckets}  # gradients in, this backward
        self.pending, self.sums, self._queued = [], {}, False
        # The one order every rank starts the buckets in (ranks pair collectives by the
        # order they are issued): the order backward usually completes them, since a
        # bucket is complete when its earliest-registered matrix is.
        self.start_order = sorted(self.buckets, key=lambda b: -min(i for r in b.rounds for i in r))
        self._started = 0
        for p, _ in self.items:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # ---- gradients: to the owners, a bucket at a time, during backward ------------------

    def _on_grad(self, p) -> None:
        if not self._queued:  # once per backward: reduce what is left when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        self.ready[self.bucket_of[p]] += 1
        while self._started < len(self.start_order):  # each complete bucket, in start_order
            b = self.start_order[self._started]
            if self.ready[b] < sum(len(r) for r in b.rounds):
                break
            self.pending.append((b, *_send_to_owners(self.muon, self.items, b)))
            self._started += 1

    def _end_of_backward(self) -> None:
        for b in self.start_order[self._started:]:  # not started (some matrix had no gradient): still join
            self.pending.append((b, *_send_to_owners(self.muon, self.items, b)))
        self.ready = {b: 0 for b in self.buckets}
        self._queued, self._started = False, 0
        for b, recv, work in self.pending:  # the owners' sums, over the micro-steps
            work.wait()
            for p, grad in _owned(b, recv, self.rank, self.items):
                self.sums[p] = grad.clone() if p not in self.sums else self.sums[p].add_(grad)
        self.pending.clear()

    def finish_gradient_synchronization(self) -> None:
        """ZeRO's shards complete; the owners' summed gradients become their .grad."""
        self.zero.finish_gradient_synchronization()
        for p, grad in self.sums.items():
            p.grad = grad
        self.sums = {}


class ShardedMuon(Muon):
    """Muon for matrices a ZeRO-3 optimizer shards (`zero`, built with others=params): step()
    sends each piece of the owners' updates, with a flag, to the rank whose shard holds it, in
    one all-to-all (weight decay and the update are elementwise: a piece is updated as the whole)."""

    def __init__(self, params, zero, **kwargs):
        super().__init__(params, **kwargs)
        self.place_on(zero)

    def place_on(self, zero) -> None:
        """Record where the matrices' pieces live in `zero`'s shards (shapes only)."""
        missing = [tuple(p.shape) for p, _ in self.matrices() if p not in zero.other_unit_of]
        if missing:
            raise ValueError(f"{len(missing)} of Muon's matrices (shapes {missing[:3]}...) are not "
                             "sharded by the ZeRO-3 optimizer: build it with others=<Muon's parameters>")
        self.zero, self.items = zero, self.matrices()
        self.routes = self._routes(self.rank_and_world()[1])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps_taken += 1
        self._to_shards(self.owned_updates())
        return loss

    def _routes(self, world: int) -> list[list[list]]:
        """routes[o][r]: (item, start, a, b) for each piece of a matrix owned by o that lies
        in rank r's shard: the matrix's flattened elements [start, start + b - a) are its
        unit's flat elements [a, b). The same on every rank (shapes only)."""
        owners = self.owners()
        routes = [[[] for _ in range(world)] for _ in range(world)]
        for i, (p, _) in enumerate(self.items):
            u = self.zero.other_unit_of[p]
            for r in range(world):
                for q, start, a, b in u.pieces(r * u.chunk, (r + 1) * u.chunk):
                    if q is p:
                        routes[owners[id(p)]][r].append((i, start, a, b))
        return routes

    @torch.no_grad()
    def _to_shards(self, updates: dict) -> None:
        """updates: p -> this rank's owned matrices' updates. Each piece travels, with a
        flag (1: an update, 0: none), to the rank holding it; each rank applies what it gets."""
        rank, world = self.rank_and_world()
        dtype, device = self.ns_dtype, self.items[0][0].device
        parts = []
        for r in range(world):
            for i, start, a, b in self.routes[rank][r]:
                u = updates.get(self.items[i][0])
                flag = torch.ones(1, dtype=dtype, device=device) if u is not None else \
                    torch.zeros(1, dtype=dtype, device=device)
                piece = u.flatten()[start:start + b - a].to(dtype) if u is not None else \
                    torch.zeros(b - a, dtype=dtype, device=device)
                parts += [flag, piece]
        send = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
        size = lambda route: sum(1 + b - a for _, _, a, b in route)
        recv = torch.empty(sum(size(self.routes[o][rank]) for o in range(world)), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, [size(self.routes[o][rank]) for o in range(world)],
                               [size(self.routes[rank][r]) for r in range(world)], group=self.group)
        offset, pieces = 0, []
        for o in range(world):
            for i, start, a, b in self.routes[o][rank]:
                pieces.append((i, a, b, offset))
                offset += 1 + b - a
        flags = recv[[off for *_, off in pieces]].tolist() if pieces else []
        for (i, a, b, off), flag in zip(pieces, flags):
            if flag == 1:
                p, g = self.items[i]
                u = self.zero.other_unit_of[p]
                shard = u.shard[a - u.lo:b - u.lo]
                shard.mul_(1 - g["lr"] * g["weight_decay"])  # as Muon._apply, on a piece
                shard.add_(recv[off + 1:off + 1 + b - a],
                           alpha=-adjust_lr(g["lr"], p.shape, g["adjust_lr_fn"]))
        self.zero.free_gathered(self.zero.other_units)  # a unit still gathered is stale now
