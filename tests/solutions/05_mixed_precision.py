"""Exercise 05 solved the way chapter 05 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

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
        self.s = float(init_scale)
        self.tracker = 0      # clean steps since the last overflow or growth
        self.streak = 0       # consecutive overflowing steps, up to now
        self.found = None     # this step's verdict: None until unscale_ decides it

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S."""
        return loss * self.s

    def get_scale(self) -> float:
        """The current S, a Python float."""
        return self.s

    @torch.no_grad()
    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by S in place; decide this step's verdict,
        the same on every rank."""
        if self.found is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for g in grads:
            g.div_(self.s)
        flag = torch.tensor([0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0])
        self.found = bool(self._agree(flag).item())

    def _agree(self, flag: torch.Tensor) -> torch.Tensor:
        """Any rank's overflow is every rank's: the flag's maximum over the ranks."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def step(self, optimizer):
        """optimizer.step() unless this step's gradients overflowed (on any rank)."""
        if self.found is None:
            self.unscale_(optimizer)
        return None if self.found else optimizer.step()

    def update(self) -> None:
        """Back off or grow S, by the rules above; forget this step's verdict."""
        if self.found is None:
            raise RuntimeError("update() with no unscale_() or step() since the last update()")
        if self.found:
            self._overflow()
        else:
            self._clean()
        self.found = None

    def _overflow(self) -> None:
        self.streak, self.tracker = self.streak + 1, 0
        if self.streak >= self.hysteresis:
            if self.s <= self.min_scale:
                raise FloatingPointError(
                    f"the loss scale is at min_scale={self.min_scale} and the gradients still "
                    "overflow: the run is diverging. Try a lower learning rate, gradient "
                    "clipping, or bf16")
            self.s = max(self.s * self.backoff_factor, self.min_scale)

    def _clean(self) -> None:
        self.streak, self.tracker = 0, self.tracker + 1
        if self.tracker == self.growth_interval:
            self.tracker = 0
            if self.s * self.growth_factor <= torch.finfo(torch.float32).max:
                self.s *= self.growth_factor

    def state_dict(self) -> dict:
        """What a checkpoint keeps: everything needed to go on exactly where it stopped."""
        return {"scale": self.s, "tracker": self.tracker, "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""
        self.s, self.tracker, self.streak = float(state["scale"]), state["tracker"], state["streak"]
        self.found = None


@torch.no_grad()
def unscale_shards(shards: list[torch.Tensor], scale: float) -> bool:
    """FIND THE BUG. Under ZeRO-2 (chapter 06) each rank holds only its own shards of the
    averaged gradients (`shards`, possibly none). Divide them by `scale` in place and say
    whether this step must be skipped: True when any gradient on any rank is inf, -inf or
    NaN, the same answer on every rank. As shipped, a job using it saw its ranks'
    parameters drift apart after the first overflow. Fix it (it must still work in one
    process, with no process group)."""
    found = torch.zeros(1)
    for g in shards:
        g.div_(scale)
        if not bool(torch.isfinite(g).all()):
            found.fill_(1.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


# Where minidist implements it; `python -m exercises.grade 05 --reference` grades it
# instead of the stub above. Leave it as it is.
REFERENCE = {
    "LossScaler": "minidist.scaler:LossScaler",
    "unscale_shards": "exercises.grader.checks_05:reference_unscale_shards",
}
