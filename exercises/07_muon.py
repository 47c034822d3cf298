"""Exercise 07: Newton-Schulz, Muon, Muon spread over ranks, and Muon on ZeRO's shards.

Muon steps each hidden weight matrix along its momentum made orthogonal: M = U S V^T
becomes about U V^T, by a few matrix products. Read chapters/07_muon.md, section 2
"Newton-Schulz: orthogonalising with matrix products", section 3 "Muon itself", section 5
"Distributed Muon: sharing the orthogonalisation" and section 7 "Muon under ZeRO".

Write, replacing each `raise NotImplementedError(...)`:
(a) newton_schulz: `steps` quintic steps with NS_COEFFICIENTS on G / ||G||_F, on the wide
    side, each matrix of a batch on its own, computed and returned in `dtype`.
(b) Muon._update and Muon.step: torch.optim.Muon's arithmetic; on N ranks each matrix has
    one owner, which alone keeps its momentum and runs its Newton-Schulz, and the updates
    reach every rank by all_gather (the constructor, _world and _apply are written for you).
(c) muon_step_on_shards: one Muon step when parameters and gradients are ZeRO shards (its
    docstring gives the layout): gradient pieces to each matrix's owner, update pieces back.

What is graded:
- (a) fp32: each singular value s of G becomes p^steps(s / ||G||_F), U and V kept
- (a) a tall matrix: the transpose of newton_schulz(G.T), with no more FLOPs
- (a) a batch: each matrix as newton_schulz of it alone
- (a) the result in `dtype` (bf16 by default), G itself unchanged, zeros for a zero matrix
- (a) bf16: bit for bit torch's own Newton-Schulz
- (b) one process: the parameters bit for bit torch.optim.Muon's (a None gradient: untouched)
- (b) 2 and 3 ranks: every rank's parameters bit for bit one process's after every step
- (b) the same with some gradients None (every rank joins every collective; 20 s: a hang)
- (b) each momentum (self.state[p]["momentum_buffer"]) on one owner; per rank at most 1/N of
      the momenta plus one matrix, exactly the Newton-Schulz FLOPs of the matrices it owns,
      and collectives sending at most 1/N of the updates plus one matrix, in bf16
- (c) 2 and 3 ranks: the shards put together == torch.optim.Muon within 1% of the movement
- (c) each matrix's momentum whole, in `momenta`, on its owner only
- (c) the bytes each rank receives: its pieces only (gradients fp32, updates bf16)

Rules: no torch.optim.Muon or torch.optim._muon._zeropower_via_newtonschulz (the oracles);
in (a) no minidist newton_schulz (ns_reference is for (b) and (c)); in (c) no all-gather of
any kind (see the README, "Exercises and grading").

Grade with `python -m exercises.grade 07` (the Muon parts start 2 and 3 processes);
`python -m exercises.grade 07 --hint` gives a hint on the first failing check, and
`python -m exercises.grade 07 --reference` grades minidist's answers (REFERENCE below).
To experiment on several processes: `minidist.launch.launch(fn, 2, *args)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.muon import adjust_lr
from minidist.muon import newton_schulz as ns_reference  # noqa: F401 - for parts (b) and (c)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # (a, b, c)


# ============================================================================ part (a)

def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T for G = U S V^T, over the last two dimensions (leading ones are
    a batch), by `steps` steps of the quintic iteration, computed in `dtype` and returned
    in `dtype`. G is not modified."""
    raise NotImplementedError(
        "newton_schulz is not written yet (`python -m exercises.grade 07 --hint` gives a hint)")


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
        raise NotImplementedError(
            "_update is not written yet (`python -m exercises.grade 07 --hint` gives a hint)")

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step of every parameter that has a gradient; on N ranks each matrix's
        update is computed by its owner only and all-gathered to every rank."""
        raise NotImplementedError(
            "step is not written yet (`python -m exercises.grade 07 --hint` gives a hint)")


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
    raise NotImplementedError(
        "muon_step_on_shards is not written yet (`python -m exercises.grade 07 --hint` gives a hint)")


# Where minidist implements each; `python -m exercises.grade 07 --reference` grades these
# instead of the stubs above. Leave it as it is. (minidist's Muon under ZeRO works on its
# own objects, not on this function's bare shards: the shards step's reference is the
# grader's own, in exercises/grader/checks_07.py.)
REFERENCE = {
    "newton_schulz": "minidist.muon:newton_schulz",
    "Muon": "minidist.muon:Muon",
    "muon_step_on_shards": "exercises.grader.checks_07:reference_muon_step_on_shards",
}
