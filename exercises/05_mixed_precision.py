"""Exercise 05: a dynamic loss scaler, GradScaler's rules plus hysteresis, for many ranks.

Chapter 05 (chapters/05_mixed_precision.md) trains in fp16, whose 5 exponent bits stop
at 65504 at the top and 2**-24 at the bottom. A language model's gradients are mostly
tiny, so in an fp16 backward many of them round to zero. The cure is to multiply the loss
by a large factor S before backward: the chain rule is linear, so every gradient comes
out S times larger, lifted into fp16's range. Before the optimizer sees them, the fp32
gradients are divided by S again ("unscaled"). Too large an S and some gradient
overflows to inf (or becomes NaN): that step is skipped and S is lowered. Too small and
underflow returns, so S is raised again after a run of clean steps. Nobody picks S by
hand: the scaler keeps it as large as it can be without overflowing, all run long.

A training step with it (the calls of torch.amp.GradScaler, which it mirrors):

    scaler.scale(loss).backward()   # gradients are S times too large
    scaler.unscale_(opt)            # divide them by S, look for inf/NaN (optional here:
    clip_grad_norm_(...)            #   step() does it if you did not; clipping needs it)
    scaler.step(opt)                # opt.step(), unless some gradient was not finite
    scaler.update()                 # back off or grow S for the next step

Implement LossScaler below, replacing each `raise NotImplementedError(...)`. Chapter 05,
sections 3 and 4, explains the rules.

The contract (the grader checks each):
- scale(loss) returns loss * S, a tensor backward can run on. get_scale() returns S, a
  Python float.
- unscale_(optimizer) divides in place every gradient the optimizer holds (p.grad of each
  p in optimizer.param_groups[i]["params"], skipping those whose grad is None) by S, and
  records this step's verdict: did any gradient hold inf, -inf or NaN? At most once per
  step: a second call before update() raises RuntimeError and divides nothing (as
  GradScaler does).
- Ranks agree. Under data parallelism one rank may overflow while the others do not, and
  with sharded gradients (chapter 06) the others cannot even see it: if ranks decided
  alone, some would step and some would not, and their parameters would drift apart.
  When a process group of more than one rank exists (dist.is_initialized() and
  dist.get_world_size() > 1), every rank reaches the same verdict, and every rank
  issues the same collectives every step, overflow or not: ranks pair their collectives
  by order, and a rank that skips one hangs the others. The verdict travels in those
  collectives: the grader records them below torch.distributed's Python, and a rank
  whose gradients overflowed must put something different into them than at a clean
  step (no other way of moving data: no process group of your own, no backend object,
  no store). Without a process group (the grader's single-process checks) call no
  collective at all.
- step(optimizer) calls unscale_ first when it was not called this step, then
  optimizer.step() only if the verdict is clean. A skipped step leaves the optimizer
  alone: no optimizer.step() call, parameters and momentum untouched.
- update() moves S for the next step, by GradScaler's rule plus hysteresis:
  * Overflow: once `hysteresis` consecutive steps have overflowed, S =
    max(S * backoff_factor, min_scale), at this overflow and at every further one of
    the same streak; an overflow also restarts the count of clean steps. With
    hysteresis=1 every overflow backs off (GradScaler's rule); with hysteresis=2 a lone
    overflow is skipped but does not lower S (DeepSpeed's hysteresis, with
    consecutive_hysteresis=True).
  * An overflow that would back off while S is already at min_scale raises
    FloatingPointError: gradients that overflow at the smallest allowed scale are not an
    underflow problem, the run is diverging. Say so in the message, and what to try
    (a lower learning rate, gradient clipping, bf16). minidist.scaler.ScaleCollapseError
    is such an error; raise it or a FloatingPointError of your own.
  * No verdict: update() with no unscale_() or step() since the last update() raises
    (GradScaler raises; RuntimeError or AssertionError) and changes nothing.
  * Clean step: it ends any overflow streak. After growth_interval clean steps in a row
    (counted since the last overflow or growth), S = S * growth_factor. As in
    GradScaler, whose S is a float32 tensor, refuse a growth that would take S above
    torch.finfo(torch.float32).max (the loss is fp32: it could not hold a larger S).
- state_dict() returns a dict of plain numbers (what torch.save keeps in a checkpoint)
  with whatever the scaler needs to go on exactly where it stopped; load_state_dict(state)
  restores it into a scaler made with the same arguments (except, possibly, init_scale).
- One optimizer per step is all the grader uses (an optimizer is anything with
  param_groups and step(): torch.optim's, or the grader's own small SGD).

The grader runs your scaler and torch.amp.GradScaler("cpu", ...) side by side (the
oracle) on random patterns of injected inf, -inf and NaN gradients, hysteresis=1, a few
hundred steps: the same S after every step, the same steps skipped, the same unscaled
gradients and parameters. It checks growth stopping at float32's maximum, hysteresis 2
and 3 against the rule above, min_scale, a state_dict round trip through torch.save,
and, on 2 ranks, that both skip when only one of them overflows. Every factor is a power
of two, so every comparison is exact.

Rule enforced in every check (a check that breaks it scores 0): no torch.amp.GradScaler
(nor torch.cuda.amp's) in what you write; it is the grader's oracle.

Find the bug: unscale_shards, at the end of the file, is shipped code with a bug; fix it.

Grade your work with `python -m exercises.grade 05` (about 5 s on a quiet 2-core
machine: it starts 2 processes once), ask for a hint on the first failing check with
`python -m exercises.grade 05 --hint` (again for the next one, `--hint K` for the K-th),
and see what full marks look like with `python -m exercises.grade 05 --reference`. To experiment, compare with GradScaler:
`torch.amp.GradScaler("cpu", init_scale=..., growth_interval=...)` takes the same calls
(call its scale() once before its first unscale_, which sets it up).
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - for you: is_initialized, all_reduce, ReduceOp


class LossScaler:
    """Dynamic loss scaler: see the rules above.

    init_scale:      the first S (2**16, as GradScaler)
    growth_factor:   S is multiplied by this after `growth_interval` consecutive clean steps
    backoff_factor:  S is multiplied by this when the overflow streak reaches `hysteresis`
    hysteresis:      consecutive overflows before backing off (1: every overflow)
    min_scale:       S never goes below this; an overflow that would back off there raises

    (minidist's LossScaler takes two more arguments, enabled and group; not needed here.)
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
    parameters drift apart after the first overflow. Fix it (call no collective without
    a process group of more than one rank)."""
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
    "unscale_shards": "exercises.checks_05:reference_unscale_shards",
}
