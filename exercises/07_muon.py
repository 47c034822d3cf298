"""Exercise 07: Newton-Schulz orthogonalisation, Muon spread over ranks, and Muon on ZeRO shards.

Chapter 07 (chapters/07_muon.md) updates each hidden weight matrix with its momentum made
orthogonal: M = U S V^T becomes (about) U V^T, every singular value close to 1, so the
step moves the matrix as far along every direction the gradient points in, not mostly
along the few with large singular values. An SVD would be slow on accelerators; a few
matrix products are fast. Three parts:

(a) newton_schulz(G, steps=5, dtype=torch.bfloat16, eps=1e-7): approximately U V^T by
    `steps` steps of the quintic Newton-Schulz iteration with Keller Jordan's
    coefficients (a, b, c) = NS_COEFFICIENTS. Divided by its Frobenius norm, G has every
    singular value in [0, 1]; each step then sends every singular value s of X to
    p(s) = a s + b s^3 + c s^5 and keeps the singular vectors U and V. p's slope at 0 is
    3.4445, so small values grow fast, and after five steps they sit in a band around 1
    (about 0.7 to 1.1). Chapter 07, section 2, derives it.

(b) Muon: an optimizer with torch.optim.Muon's arithmetic that, on N ranks, gives each
    weight matrix one owner rank. Only the owner keeps the matrix's momentum (1/N of the
    optimizer state per rank) and runs its Newton-Schulz (1/N of the work); the
    orthogonalised updates reach every rank by all_gather, and every rank applies every
    update. The constructor (the same as minidist.muon.Muon's), _world() and _apply() are
    written for you below; write _update() and step(). Chapter 07, sections 3 and 5.

(c) Muon on shards: muon_step_on_shards, one distributed Muon step when the parameters
    and the averaged gradients are ZeRO shards (chapter 06's flat layout) and no rank
    holds a whole matrix. Each matrix's owner gathers its gradient whole, keeps its
    momentum, runs Newton-Schulz, and sends each rank the piece of the update that lies
    in that rank's shard. Its docstring, below, states the setting.

Implement, replacing each `raise NotImplementedError(...)`: newton_schulz, Muon._update,
Muon.step and muon_step_on_shards.

What the grader checks in (a):
- fp32: each singular value s of G comes out as p applied `steps` times to s / ||G||_F,
  with U and V kept.
- The last two dimensions are the matrix; leading ones are a batch: each matrix of the
  batch is its own problem, normalised by its own norm, and the result equals
  newton_schulz of each matrix alone.
- A tall matrix (rows > cols) gives the transpose of the wide case, iterated on the wide
  side: the Gram matrix is then min(rows, cols) square, the cheaper one. The grader
  counts the FLOPs.
- The iteration runs in `dtype` and the result has that dtype; G itself is left as it
  was (Muon hands you its momentum buffer: changing it in place would corrupt it).
- An all-zero matrix gives zeros, not NaN: that is what eps is for.
- In bf16 the result equals torch's own Newton-Schulz to the bit
  (torch.optim._muon._zeropower_via_newtonschulz, the oracle): the same mathematics
  rounded differently does not pass.
- Part (a) is yours: ns_reference (minidist's newton_schulz, imported below for parts
  (b) and (c)) trips while part (a) is checked, under any name; a check that reaches it
  scores 0.

What the grader checks in (b):
- One process (no process group, or one of a single rank): equal to torch.optim.Muon,
  bit for bit (momentum, Nesterov or not, decoupled weight decay, the shape-adjusted
  learning rate). A parameter whose grad is None is left alone: no momentum, no weight
  decay, no step.
- 2 and 3 ranks (data parallelism: every rank holds the same parameters and, after the
  all-reduce of chapter 03, the same gradients; all ranks agree which are None): every
  rank's parameters equal one process's after every step, to the bit.
- Every matrix has one owner rank, the same on every rank; only the owner keeps its
  momentum, in self.state[p]["momentum_buffer"] (where the grader looks for who owns
  what), and runs its Newton-Schulz. Each rank's share of the momentum is at most
  total / N plus the largest matrix, counting every tensor the optimizer can reach
  (besides the parameters and their gradients), wherever it is kept.
- The work is where the ownership says: each step, the FLOPs of each rank's matrix
  products (counted below Python, on every thread) are exactly those of the
  Newton-Schulz of the matrices it owns that have a gradient.
- The updates travel in the collectives: the grader records what every rank puts into
  them (below torch.distributed's Python), and each update of each step must be among
  it, bit for bit. No other way of moving data (a process group of your own, a group's
  backend object, the rendezvous store).
- Every rank joins every collective, in the same order, with the same sizes, also when
  some gradients are None: a rank that skips one leaves the others waiting, and a rank
  that waits more than 20 seconds for the others (a hang) fails its check.
- Use self._world() for the rank and world size, and group=self.group in every
  collective.
- Part (b) orthogonalises with ns_reference, minidist's newton_schulz (imported below),
  so its marks do not depend on part (a); your newton_schulz gives the same bits once it
  matches torch's.

What the grader checks in (c), on 2 and 3 ranks (5 matrices of uneven shapes, so neither
world size divides their number, the padded layout, and matrices that straddle two
ranks' shards; the owners are not the ranks that hold the matrices), over 3 steps:
- The shards of all ranks, put back together, equal torch.optim.Muon's parameters on the
  whole matrices after every step, within 1% of how far each matrix has moved from its
  start (the largest element of the difference against the largest of the movement).
  Why 1%: the update is bf16, 8 significant bits, so one rounding moves an element by
  up to 2^-8 = 0.4% of its size. Moving the exact fp32 gradient pieces and the bf16
  update pieces gives torch's bits (the reference does); the slack allows a rounding or
  two. Send the gradients in fp32: rounded to bf16 on the way they change Newton-Schulz's
  own bf16 roundings, which moved these matrices by up to 2.4% (measured with the
  grader's matrices). Forgetting the momentum, or the weight decay, is off by a quarter
  and more here, and an update applied to the wrong piece by far more.
- Each matrix's momentum is in `momenta` on its owner only, whole (rows x cols), equal
  to torch.optim.Muon's momentum_buffer within the same 1%.
- The pieces travel in the recorded messages and collectives: each rank's sends of a
  step hold, bit for bit, its gradient shard's pieces of the matrices others own, and
  each piece of update a rank applies is, to rounding, among what the owner sent.
- Bytes received per rank per step (every collective and recv, recorded below Python)
  at most 4 x G + 2 x U + 64 bytes per matrix: G the elements of the matrices it owns
  that lie outside its shard (gradients, fp32), U the elements of its shard whose
  matrix another rank owns (updates, in ns_dtype, bf16: as Muon's all_gather sends
  them). Summed over ranks G and U are each about Psi_muon (N - 1) / N when ownership
  does not follow the layout (Psi_muon: the matrices' elements), the elements ZeRO's
  reduce-scatter and all-gather move. Gloo's dist.gather and dist.scatter need equal
  sizes on every rank, and padding to the largest piece can exceed the bound: send the
  exact pieces (dist.all_to_all_single with split sizes, or dist.isend and dist.irecv).

Rules enforced in every check (a check that breaks one scores 0): no torch.optim.Muon
and no torch.optim._muon._zeropower_via_newtonschulz in what you write: they are the
grader's oracles. In part (c) no all-gather of any kind (dist.all_gather,
all_gather_into_tensor, all_gather_object, ...): it would hand every rank every shard,
which is what ZeRO avoids.

Grade your work with

    python -m exercises.grade 07

(about 6 s on a quiet 2-core machine: the Muon checks start 2 and 3 processes), and see
what full marks look like with `python -m exercises.grade 07 --reference`, which grades
minidist's own implementations (named in REFERENCE below) instead of yours.

Ask for a hint on the first failing check with `python -m exercises.grade 07 --hint`
(again for the next one; `--hint K` for the K-th).

To experiment, run a function of your own on several processes with
`minidist.launch.launch(fn, 2, *args)`: it returns each rank's return value and re-raises a
rank's exception here, with "[rank r of 2]" in front. torch.optim.Muon is the
single-process oracle: `torch.optim.Muon(params, lr=..., weight_decay=..., momentum=...,
nesterov=..., ns_steps=..., adjust_lr_fn=...)` (pass them all: its defaults differ).
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # for you: all_gather, all_to_all_single (and _world, below)

from minidist.muon import adjust_lr
from minidist.muon import newton_schulz as ns_reference  # noqa: F401 - for you, in part (b)

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
# grader's own, in exercises/checks_07.py.)
REFERENCE = {
    "newton_schulz": "minidist.muon:newton_schulz",
    "Muon": "minidist.muon:Muon",
    "muon_step_on_shards": "exercises.checks_07:reference_muon_step_on_shards",
}
