"""Exercise 07 solved the way chapter 07 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.muon import adjust_lr  # (minidist's newton_schulz, ns_reference, is not needed: ours is its equal)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # (a, b, c)


# ============================================================================ part (a)

def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T for G = U S V^T, over the last two dimensions (leading ones are
    a batch), by `steps` steps of the quintic iteration, computed in `dtype` and returned
    in `dtype`. G is not modified."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)  # a copy unless G already has dtype: never changed in place below
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        X = X.mT
    batch = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # (batch, m, n), m <= n
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # singular values in [0, 1]
    for _ in range(steps):
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A A
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = X.reshape(*batch, *X.shape[-2:])
    return X.mT if tall else X


# ============================================================================ part (b)

class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters, with torch.optim.Muon's arithmetic, spread over the ranks
    of a process group when one of more than one rank exists (or `group` is given).
    `ns_dtype` is the precision of the Newton-Schulz iteration. In a distributed run
    step() is a collective: every rank calls it."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 ns_dtype: torch.dtype = torch.bfloat16, group=None):
        # written for you: the same checks and settings as minidist.muon.Muon
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
                    raise ValueError(f"Muon is for 2-D weight matrices; got a parameter of "
                                     f"shape {tuple(p.shape)}")
        self.ns_dtype, self.group = ns_dtype, group

    def _world(self) -> tuple[int, int]:
        """(rank, world size): (0, 1) without a process group. Written for you."""
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, g: dict) -> None:
        """Decoupled weight decay, then the step with the shape-adjusted learning rate, in
        torch.optim.Muon's order. `update` may arrive flattened (from an all_gather) and
        in ns_dtype. Written for you."""
        p.mul_(1 - g["lr"] * g["weight_decay"])
        p.add_(update.view_as(p), alpha=-adjust_lr(g["lr"], p.shape, g["adjust_lr_fn"]))

    def _update(self, p: torch.Tensor, g: dict) -> torch.Tensor:
        """The owner's work for parameter p of param group g: update its momentum (kept in
        self.state[p]["momentum_buffer"]) with p.grad and return the orthogonalised
        (Nesterov) momentum, in self.ns_dtype."""
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - g["momentum"])  # buf = m buf + (1 - m) grad
        M = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        return newton_schulz(M, g["ns_steps"], self.ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step of every parameter that has a gradient; on N ranks each matrix's
        update is computed by its owner only and all-gathered to every rank."""
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
        # the deal: by Newton-Schulz cost, largest first (ties in order), rounds of N
        cost = [min(p.shape) ** 2 * max(p.shape) for p, _ in items]
        order = sorted(range(len(items)), key=lambda i: -cost[i])
        for start in range(0, len(order), world):
            round_ = order[start:start + world]
            send = torch.zeros(1 + max(items[i][0].numel() for i in round_), dtype=self.ns_dtype)
            if rank < len(round_) and items[round_[rank]][0].grad is not None:
                update = self._update(*items[round_[rank]]).flatten()
                send[0], send[1:1 + update.numel()] = 1, update
            slots = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(slots, send, group=self.group)
            for owner, i in enumerate(round_):  # every rank applies every update
                if slots[owner][0] == 1:
                    p, g = items[i]
                    self._apply(p, slots[owner][1:1 + p.numel()], g)
        return loss


# ============================================================================ part (c)

def muon_step_on_shards(param_shard: torch.Tensor, grad_shard: torch.Tensor, shapes: list,
                        owners: list, momenta: dict, lr: float = 0.02, momentum: float = 0.95,
                        nesterov: bool = True, weight_decay: float = 0.0, ns_steps: int = 5,
                        adjust_lr_fn: str | None = None, ns_dtype: torch.dtype = torch.bfloat16,
                        group=None) -> None:
    """One Muon step of the matrices `shapes` when they are laid out as ZeRO lays out a unit
    (minidist/zero/layout.py, chapter 06): matrix i flattened (row-major), the matrices
    concatenated in order, the whole padded with zeros to a multiple of N (the world
    size); S = padded length / N, and rank r holds elements [r*S, (r+1)*S).

    param_shard  this rank's S elements of the parameters (float32): update it IN PLACE
    grad_shard   this rank's S elements of the gradient, already averaged over ranks
    shapes       [(rows, cols)] of each matrix, the same on every rank
    owners       owners[i] is the rank that owns matrix i, the same on every rank
    momenta      {i: momentum of matrix i (rows x cols)}: the caller passes the same dict
                 at every step; keep in it only the matrices this rank owns (create each
                 as zeros at the first step)
    lr, momentum, nesterov, weight_decay, ns_steps, adjust_lr_fn: torch.optim.Muon's
                 arguments (adjust_lr(lr, shape, adjust_lr_fn) scales each matrix's lr)
    ns_dtype     the Newton-Schulz precision;  group: the process group (None: default)

    A collective: every rank calls it. Steps: (1) each matrix's gradient whole on its
    owner (every rank sends the owner the piece of the matrix that lies in its shard);
    (2) on the owner: momentum, Newton-Schulz (ns_reference, or your newton_schulz);
    (3) each rank receives, from each owner, the piece of that owner's update that lies
    in its shard; (4) each rank applies what lies in its shard: decoupled weight decay,
    then the step with the adjusted learning rate (Muon._apply's arithmetic, on a piece).
    Everything is computable from shapes and owners on every rank: no sizes to exchange.
    No all-gather of any kind."""
    rank, n, S = dist.get_rank(group), dist.get_world_size(group), param_shard.numel()
    start = [0]
    for rows, cols in shapes:
        start.append(start[-1] + rows * cols)

    def span(i, j):  # matrix i's elements in rank j's shard, [lo, hi) in flat coordinates
        lo = max(start[i], j * S)
        return lo, max(lo, min(start[i + 1], (j + 1) * S))

    mine = [i for i, o in enumerate(owners) if o == rank]
    # (1) to each owner j, my shard's pieces of the matrices j owns (matrix order)
    send = [grad_shard[slice(*(x - rank * S for x in span(i, rank)))] for j in range(n)
            for i in range(len(shapes)) if owners[i] == j]
    in_sizes = [sum(span(i, rank)[1] - span(i, rank)[0] for i in range(len(shapes)) if owners[i] == j)
                for j in range(n)]
    out_sizes = [sum(span(i, j)[1] - span(i, j)[0] for i in mine) for j in range(n)]
    recv = grad_shard.new_empty(sum(out_sizes))
    dist.all_to_all_single(recv, torch.cat(send), out_sizes, in_sizes, group=group)
    # (2) the owner's work: each matrix whole (the ranks' pieces in order), momentum, Newton-Schulz
    pieces = {i: [] for i in mine}
    for j, part in enumerate(recv.split(out_sizes)):
        for i, piece in zip(mine, part.split([span(i, j)[1] - span(i, j)[0] for i in mine])):
            pieces[i].append(piece)
    updates = {}
    for i in mine:
        grad = torch.cat(pieces[i]).view(shapes[i])
        buf = momenta.setdefault(i, torch.zeros_like(grad))
        buf.lerp_(grad, 1 - momentum)
        M = grad.lerp(buf, momentum) if nesterov else buf
        updates[i] = newton_schulz(M, ns_steps, ns_dtype).flatten()
    # (3) to each rank j, the pieces of my updates that lie in its shard; from each owner, mine
    send = [updates[i][slice(*(x - start[i] for x in span(i, j)))] for j in range(n) for i in mine]
    recv = torch.empty(sum(in_sizes), dtype=ns_dtype)
    send = torch.cat(send) if send else torch.empty(0, dtype=ns_dtype)  # (a rank may own nothing)
    dist.all_to_all_single(recv, send, in_sizes, out_sizes, group=group)
    # (4) decay and step on each piece of my shard, in the order the owners sent them
    at = 0
    for j in range(n):
        for i in range(len(shapes)):
            if owners[i] != j:
                continue
            lo, hi = span(i, rank)
            p = param_shard[lo - rank * S:hi - rank * S]
            p.mul_(1 - lr * weight_decay)
            p.add_(recv[at:at + hi - lo], alpha=-adjust_lr(lr, shapes[i], adjust_lr_fn))
            at += hi - lo


# Where minidist implements each; `python -m exercises.grade 07 --reference` grades these
# instead of the stubs above. Leave it as it is. (minidist's Muon under ZeRO works on its
# own objects, not on this function's bare shards: the shards step's reference is the
# grader's own, in exercises/grader/checks_07.py.)
REFERENCE = {
    "newton_schulz": "minidist.muon:newton_schulz",
    "Muon": "minidist.muon:Muon",
    "muon_step_on_shards": "exercises.grader.checks_07:reference_muon_step_on_shards",
}
