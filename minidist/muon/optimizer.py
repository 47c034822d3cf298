"""Muon: momentum, orthogonalised by Newton-Schulz, shared across ranks. Chapter 07
(chapters/07_muon.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --optimizer muon
    python -m minidist.bench muon
    pytest tests/test_muon.py

Muon.step is minidist/muon/plain.py's arithmetic (read it first), its rounds packed in
buckets of about 4 MB, each bucket's all-gather overlapping the next one's Newton-Schulz.
Which parameters belong to Muon is decided once (split_params) and checked after the
first step (check_routing): a wrong routing trains silently with the wrong optimizer.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.muon.orthogonalize import NS_COEFFICIENTS, newton_schulz, newton_schulz_many, schedule
from minidist.muon.plain import check_hyperparameters

__all__ = ["NS_COEFFICIENTS", "newton_schulz", "adjust_lr", "Muon", "RoundBucket", "plan_buckets",
           "hidden_matrices", "split_params", "check_routing"]


def adjust_lr(lr: float, shape, how: str | None = None) -> float:
    """The learning rate for a matrix of `shape` (rows = fan-out, cols = fan-in). "original"
    (None): times sqrt(max(1, rows/cols)), so tall matrices are not under-updated.
    "match_rms_adamw": times 0.2 sqrt(max(rows, cols)), the RMS of a typical AdamW update, so
    AdamW's learning rate and weight decay carry over (Liu et al., 2025, "Muon is Scalable")."""
    rows, cols = shape[0], shape[1]
    if how in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {how!r}")


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters, as torch.optim.Muon, spread over ranks when a process group
    of more than one rank exists (or `group` is given). `ns_dtype` is the Newton-Schulz
    precision, `ns_coefficients` "jordan" (torch's), "polar_express" or a tuple (a, b, c).
    `batched`: matrices of one shape in one batched chain (False: one by one). Distributed,
    step() is a collective; `bucket_mb`: about the bytes each all-gather carries."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 ns_dtype: torch.dtype = torch.bfloat16, group=None, bucket_mb: float = 4.0,
                 ns_coefficients="jordan", batched: bool = True):
        check_hyperparameters(lr, momentum, weight_decay, ns_steps)
        adjust_lr(1.0, (1, 1), adjust_lr_fn)  # rejects an unknown name now, not at step 1
        schedule(ns_coefficients, ns_steps)  # likewise an unknown coefficient choice
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_coefficients=ns_coefficients)
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon is for 2-D weight matrices; got a parameter of shape "
                                     f"{tuple(p.shape)}: give it to AdamW (see muon.split_params)")
        self.ns_dtype, self.group, self.bucket_mb, self.batched = ns_dtype, group, bucket_mb, batched
        self.steps_taken = 0  # check_routing reads it: did Muon run at all?

    def rank_and_world(self) -> tuple[int, int]:
        """(rank, world size) of this Muon's group; (0, 1) without a process group."""
        return self._world()  # (exercise 07's tests override _world)

    def _world(self) -> tuple[int, int]:
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    # ------------------------------------------------------------ the owner's work

    def _momentum(self, p: torch.Tensor, g: dict) -> torch.Tensor:
        """Update p's momentum and return the matrix to orthogonalise (Nesterov looks ahead)."""
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - g["momentum"])  # buf = m buf + (1 - m) grad
        return p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf

    def _update(self, p: torch.Tensor, g: dict) -> torch.Tensor:
        """One matrix's update: momentum, then Newton-Schulz."""
        return newton_schulz(self._momentum(p, g), g["ns_steps"], self.ns_dtype, coefficients=g["ns_coefficients"])

    def _updates(self, pairs: list) -> list[torch.Tensor]:
        """The updates of [(p, group)], batched by shape and Newton-Schulz settings."""
        if not self.batched:
            return [self._update(p, g) for p, g in pairs]
        out, same = [None] * len(pairs), {}
        for k, (p, g) in enumerate(pairs):
            c = g["ns_coefficients"]
            same.setdefault((g["ns_steps"], c if isinstance(c, str) else tuple(c)), []).append(k)
        for (steps, coefficients), ks in same.items():
            momenta = [self._momentum(*pairs[k]) for k in ks]
            for k, O in zip(ks, newton_schulz_many(momenta, steps, self.ns_dtype,
                                                   coefficients=coefficients)):
                out[k] = O
        return out

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, g: dict) -> None:
        p.mul_(1 - g["lr"] * g["weight_decay"])  # decoupled weight decay
        p.add_(update.view_as(p), alpha=-adjust_lr(g["lr"], p.shape, g["adjust_lr_fn"]))

    # ------------------------------------------------------------ who owns what

    @staticmethod
    def deal(items: list) -> list[int]:
        """The matrices dealt out by cost, largest first, N per round: rank r owns the r-th
        of each round. Newton-Schulz on an m x n matrix (m <= n) costs about m*m*n."""
        cost = lambda i: min(items[i][0].shape) ** 2 * max(items[i][0].shape)
        return sorted(range(len(items)), key=lambda i: (-cost(i), i))

    def owners(self) -> dict[int, int]:
        """id(parameter) -> the rank that keeps its momentum and orthogonalises it."""
        _, world = self.rank_and_world()
        items = self.matrices()
        return {id(items[i][0]): j % world for j, i in enumerate(self.deal(items))}

    def matrices(self) -> list[tuple]:
        """[(parameter, its param group)] in the groups' order: the items deal() indexes."""
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def owned_updates(self) -> dict:
        """{parameter: update} for the matrices with a gradient that this rank owns."""
        (rank, _), owners = self.rank_and_world(), self.owners()
        mine = [(p, g) for p, g in self.matrices() if owners[id(p)] == rank and p.grad is not None]
        return {p: u for (p, _), u in zip(mine, self._updates(mine))}

    def state_pieces(self) -> tuple[list, list]:
        """What this rank holds, for minidist.checkpoint: the momentum of the matrices it
        owns, whole, (p, 0, p, 0, p.numel()); no pieces of parameters (whole everywhere)."""
        (rank, _), owners = self.rank_and_world(), self.owners()
        return [(p, 0, p, 0, p.numel()) for p, _ in self.matrices() if owners[id(p)] == rank], []

    # ------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        """As minidist.muon.plain.PlainMuon.step, rounds in buckets. Under ZeRO the gradients
        must reach their owners first (minidist/compose/zero_muon.py)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps_taken += 1
        rank, world = self.rank_and_world()
        items = self.matrices()
        if world == 1:
            todo = [(p, g) for p, g in items if p.grad is not None]
            for (p, g), update in zip(todo, self._updates(todo)):
                self._apply(p, update, g)
            return loss
        # N ranks: in each bucket of rounds, the owners compute, batched by shape; one
        # all-gather per bucket hands out the updates while the next bucket computes.
        in_flight = []
        for bucket in plan_buckets(items, self.deal(items), world, self.bucket_mb * 2**20, self.ns_dtype):
            mine = [i for i in bucket.owned_by(rank) if items[i][0].grad is not None]
            updates = dict(zip(mine, self._updates([items[i] for i in mine])))
            send = bucket.pack(rank, updates, self.ns_dtype, items[0][0].device)
            recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
            work = dist.all_gather_single(recv, send, group=self.group, async_op=True)
            in_flight.append((bucket, recv, work))
        # Every rank applies every update, in the same order, to the same values.
        for bucket, recv, work in in_flight:
            work.wait()
            for i, update in bucket.unpack(recv.view(world, -1), items):
                self._apply(items[i][0], update, items[i][1])
        return loss


# ---------------------------------------------------------------- packing: rounds into buckets

class RoundBucket:
    """Consecutive rounds whose updates travel in one all-gather: per rank, one slot per round,
    [has_update, update, padding], sized by the round's largest matrix, so every rank computes
    the same layout and 'no update' travels as data (flag 0), no collective skipped."""

    def __init__(self, rounds: list[list[int]], items: list):
        self.rounds, self.slots, offset = rounds, [], 0  # slots: (offset, size) per round
        for round_ in rounds:
            size = 1 + max(items[i][0].numel() for i in round_)
            self.slots.append((offset, size))
            offset += size
        self.numel = offset

    def owned_by(self, rank: int) -> list[int]:
        return [round_[rank] for round_ in self.rounds if rank < len(round_)]

    def pack(self, rank: int, updates: dict, dtype, device) -> torch.Tensor:
        """This rank's part: its updates (item index -> tensor) in their slots."""
        send = torch.zeros(self.numel, dtype=dtype, device=device)
        for round_, (offset, _) in zip(self.rounds, self.slots):
            if rank < len(round_) and round_[rank] in updates:
                update = updates[round_[rank]].flatten()
                send[offset] = 1
                send[offset + 1:offset + 1 + update.numel()] = update
        return send

    def unpack(self, recv: torch.Tensor, items: list):
        """(item index, update) for every slot of every rank whose flag is set."""
        flags = recv[:, [offset for offset, _ in self.slots]].tolist()  # one read, not one per slot
        for k, (round_, (offset, _)) in enumerate(zip(self.rounds, self.slots)):
            for owner, i in enumerate(round_):  # rank `owner` computed matrix i
                if flags[owner][k] == 1:
                    yield i, recv[owner, offset + 1:offset + 1 + items[i][0].numel()]


def plan_buckets(items: list, order: list[int], world: int, bucket_bytes: float, dtype) -> list[RoundBucket]:
    """The dealt order cut into rounds of `world`, the rounds packed into buckets of about
    bucket_bytes per rank's part (a few collectives: each has a fixed latency)."""
    rounds = [order[s:s + world] for s in range(0, len(order), world)]
    buckets, current, size = [], [], 0
    for round_ in rounds:
        current.append(round_)
        size += (1 + max(items[i][0].numel() for i in round_)) * dtype.itemsize
        if size >= bucket_bytes:
            buckets.append(RoundBucket(current, items))
            current, size = [], 0
    if current:
        buckets.append(RoundBucket(current, items))
    return buckets


# ---------------------------------------------------------------- routing: which parameters are Muon's

def hidden_matrices(model: nn.Module) -> dict[int, str]:
    """id -> name of the parameters meant for Muon, judged by what holds them, not by their
    shape now (a sharded matrix is still one): nn.Linear weights and other 2-D parameters,
    except embeddings and the output head (lm_head), for which AdamW works better."""
    skip = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) or getattr(m, "is_lookup", False)
            for p in m.parameters()}  # (is_lookup: a table of another class, e.g. split by vocabulary)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        skip |= {id(p) for p in head.parameters()}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return {id(p): n for n, p in model.named_parameters()  # a tied parameter comes once
            if id(p) not in skip and (id(p) in linear or p.dim() == 2)}


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's): the hidden matrices (hidden_matrices) and the rest.
    Refuses a hidden matrix that is not 2-D any more: split while parameters are whole."""
    hidden = hidden_matrices(model)
    muon, other = [], []
    for name, p in model.named_parameters():
        if id(p) in hidden and p.dim() != 2:
            raise ValueError(f"split_params: {name} is a weight matrix but has shape {tuple(p.shape)} here "
                             "(flattened or sharded?): split before any wrapper flattens the parameters")
        (muon if id(p) in hidden else other).append(p)
    return muon, other


def check_routing(model: nn.Module, optimizers) -> None:
    """Call once after the first optimizer step: raises RuntimeError naming each parameter
    on the wrong optimizer unless every hidden matrix was stepped by a Muon and by nothing
    else, and Muon held nothing else."""
    names = {id(p): (n, tuple(p.shape)) for n, p in model.named_parameters()}
    hidden = hidden_matrices(model)
    stepped_by_muon, held_elsewhere = set(), {}
    muons = [o for o in optimizers if isinstance(o, Muon)]
    for o in optimizers:
        ids = {id(p) for g in o.param_groups for p in g["params"]}
        if isinstance(o, Muon):
            stepped_by_muon |= ids if o.steps_taken else set()
        else:
            held_elsewhere.update({i: type(o).__name__ for i in ids})
    problems = []
    for i, name in hidden.items():
        shape = names[i][1]
        flat = "" if len(shape) == 2 else f" (it is {len(shape)}-D here: route before flattening)"
        if i in held_elsewhere:
            problems.append(f"{name} {shape} is a hidden matrix but {held_elsewhere[i]} holds it{flat}")
        elif i not in stepped_by_muon:
            why = "no Muon was given" if not muons else "no Muon holding it has stepped"
            problems.append(f"{name} {shape} is a hidden matrix and Muon did not update it ({why}){flat}")
    for i in stepped_by_muon - hidden.keys():
        name, shape = names.get(i, ("a parameter that is not the model's", ()))
        problems.append(f"{name} {shape} was updated by Muon but is not a hidden matrix "
                        "(embedding, head, gain or bias): give it to AdamW (minidist.muon.split_params)")
    if problems:
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise RuntimeError("Muon routing check failed after the first step:\n  "
                           + "\n  ".join(problems[:5]) + more)
