"""Exercise 05: a dynamic loss scaler, GradScaler's rules plus hysteresis, for many ranks.

fp16 stops at 2**-24 at the bottom, and a language model's gradients are mostly tiny: in
an fp16 backward many round to zero. The cure: multiply the loss by a large S before
backward (every gradient comes out S times larger), divide the gradients by S before the
optimizer sees them, skip a step whose gradients overflowed (inf, -inf or NaN) and lower S,
raise S again after a run of clean steps. Read chapters/05_mixed_precision.md, section 4
"Dynamic loss scaling: `minidist.scaler.LossScaler`" (and section 3 for why).

A training step with it (the calls of torch.amp.GradScaler, which it mirrors):

    scaler.scale(loss).backward()   # gradients are S times too large
    scaler.unscale_(opt)            # divide them by S, find inf/NaN (optional: step() does it)
    scaler.step(opt)                # opt.step(), unless some gradient was not finite
    scaler.update()                 # back off or grow S for the next step

Write LossScaler (its docstring states the rules) and fix unscale_shards (find the bug).

What is graded (the oracle: torch.amp.GradScaler("cpu"), run by the grader on the same
gradients, with inf, -inf and NaN injected; every factor a power of two, so all is exact):
- scale() and unscale_(): loss * S, the gradients divided by S once per step
- hysteresis=1, random inf, -inf and NaN: the same S, skipped steps and parameters as
  GradScaler (a skipped step leaves the optimizer alone)
- growth stops at float32's maximum, as GradScaler's
- hysteresis 2 and 3: back off once consecutive overflows reach it; every overflow skips
- misuse refused as GradScaler does: a second unscale_() in a step, update() without a verdict
- min_scale: S stops there; an overflow there raises an error saying what to try
- state_dict through torch.save: a new scaler goes on exactly where it stopped
- 2 ranks, inf/NaN on one rank only: every rank skips and backs off alike
- find the bug: unscale_shards gives every rank the same verdict (sharded gradients)

Rule: no GradScaler of torch.amp, torch.cuda.amp, torch.cpu.amp (see the README, "Exercises and grading").

Grade your work with `python -m exercises.grade 05` (about 5 s; it starts 2 processes), ask
for a hint on the first failing check with `python -m exercises.grade 05 --hint`, and see
what full marks look like with `python -m exercises.grade 05 --reference`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401


class LossScaler:
    """Dynamic loss scaler.

    init_scale:      the first S (2**16, as GradScaler)
    growth_factor:   S is multiplied by this after `growth_interval` consecutive clean steps
    backoff_factor:  S is multiplied by this when the overflow streak reaches `hysteresis`
    hysteresis:      consecutive overflows before backing off (1: every overflow)
    min_scale:       S never goes below this; an overflow that would back off there raises

    The rules:
    - scale(loss) returns loss * S, a tensor backward can run on; get_scale() S, a float.
    - unscale_(optimizer) divides in place every p.grad of the optimizer's param_groups
      (skipping None) by S and records this step's verdict: did any gradient hold inf,
      -inf or NaN? A second call before update() raises RuntimeError and divides nothing.
    - Ranks agree: with a process group of more than one rank (dist.is_initialized() and
      dist.get_world_size() > 1) every rank reaches the same verdict, and every rank issues
      the same collectives every step, overflow or not (a rank that skips one hangs the
      others). Without a process group call no collective at all.
    - step(optimizer) calls unscale_ first if it was not called this step, then
      optimizer.step() only on a clean verdict; a skipped step leaves the optimizer alone.
    - update() moves S for the next step:
      * overflow: once `hysteresis` consecutive steps have overflowed, S = max(S *
        backoff_factor, min_scale), at this overflow and every further one of the streak;
        an overflow also restarts the count of clean steps. An overflow that would back off
        with S already at min_scale raises FloatingPointError (minidist.scaler's
        ScaleCollapseError is one), saying the run diverges and what to try (a lower
        learning rate, gradient clipping, bf16).
      * clean step: ends any overflow streak; after growth_interval clean steps in a row
        (since the last overflow or growth) S = S * growth_factor, unless that would take S
        above torch.finfo(torch.float32).max.
      * no verdict since the last update() (no unscale_() or step()): raise (RuntimeError
        or AssertionError, as GradScaler) and change nothing.
    - state_dict() returns plain numbers with all the scaler needs to go on exactly where
      it stopped; load_state_dict(state) restores it into a scaler made with the same
      arguments (except, possibly, init_scale).
    An optimizer is anything with param_groups and step(); one per step.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = 1.0):
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale
        raise NotImplementedError(
            "LossScaler.__init__ is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S."""
        raise NotImplementedError(
            "scale is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")

    def get_scale(self) -> float:
        """The current S, a Python float."""
        raise NotImplementedError(
            "get_scale is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")

    @torch.no_grad()
    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by S in place; decide this step's verdict,
        the same on every rank."""
        raise NotImplementedError(
            "unscale_ is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")

    def step(self, optimizer):
        """optimizer.step() unless this step's gradients overflowed (on any rank)."""
        raise NotImplementedError(
            "step is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")

    def update(self) -> None:
        """Back off or grow S, by the rules above; forget this step's verdict."""
        raise NotImplementedError(
            "update is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")

    def state_dict(self) -> dict:
        """What a checkpoint keeps: everything needed to go on exactly where it stopped."""
        raise NotImplementedError(
            "state_dict is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""
        raise NotImplementedError(
            "load_state_dict is not written yet (`python -m exercises.grade 05 --hint` gives a hint)")


@torch.no_grad()
def unscale_shards(shards: list[torch.Tensor], scale: float) -> bool:
    """FIND THE BUG. Under ZeRO-2 (chapter 06) each rank holds only its own shards of the
    averaged gradients (`shards`, possibly none). Divide them by `scale` in place and say
    whether this step must be skipped: True when any gradient on any rank is inf, -inf or
    NaN, the same answer on every rank. As shipped, a job using it saw its ranks'
    parameters drift apart after the first overflow. Fix it (it must still work in one
    process, with no process group)."""
    found = False
    for g in shards:
        g.div_(scale)
        if not bool(torch.isfinite(g).all()):
            found = True
    return found


# Where minidist implements it; `python -m exercises.grade 05 --reference` grades it
# instead of the stub above. Leave it as it is.
REFERENCE = {
    "LossScaler": "minidist.scaler:LossScaler",
    "unscale_shards": "exercises.grader.checks_05:reference_unscale_shards",
}
