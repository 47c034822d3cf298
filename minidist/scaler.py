"""Dynamic loss scaling for fp16 training: Chapter 05 (chapters/05_mixed_precision.md).
Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --precision fp16
    pytest tests/test_scaler.py

fp16's smallest positive value is 2**-24, so most of a language model's gradients underflow
in an fp16 backward. Multiplying the loss by S lifts every gradient by S; unscaling the fp32
gradients gives the true ones back. A step whose gradients overflow is skipped and S
lowered; after a run of clean steps S grows. bf16 has fp32's range and needs none of it.
The usage mirrors torch.amp.GradScaler, the tests' oracle. Read PlainScaler, the idea
alone in one process, then LossScaler, what train_gpt uses: the inf/NaN flag agrees across
ranks (an all-reduce with MAX, so ZeRO's shards skip the same steps), plus hysteresis (as
DeepSpeed's) and min_scale, past which the run stops with an error saying what to try.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FP32_MAX = torch.finfo(torch.float32).max


def _f32(x: float) -> float:
    """x rounded to float32, the dtype GradScaler keeps its scale in (inf if too large)."""
    return torch.tensor(x, dtype=torch.float64).float().item()


class PlainScaler:
    """The plain dynamic loss scaler, in one process: the whole idea in four calls. With the
    same settings it takes the decisions torch.amp.GradScaler takes (tests/test_scaler.py)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.s = _f32(init_scale)  # the scale S, kept in float32 as GradScaler keeps it
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0  # consecutive steps without an overflow
        self.found_inf = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.s  # every gradient of backward is now S times too large

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients; take the step only if all of them are finite."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for g in grads:
            g.mul_(1.0 / self.s)
        self.found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not self.found_inf:
            optimizer.step()

    def update(self) -> None:
        """Halve S after an overflow; double it after growth_interval clean steps."""
        if self.found_inf:
            self.s, self.clean_steps = _f32(self.s * self.backoff_factor), 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            grown = _f32(self.s * self.growth_factor)
            self.s = grown if grown <= FP32_MAX else self.s  # never grow to inf
            self.clean_steps = 0


class ScaleCollapseError(FloatingPointError):
    """The gradients overflow even at min_scale: the run is diverging, not underflowing."""


class LossScaler:
    """Dynamic loss scaler.

    init_scale:      the first S (2**16, as GradScaler).
    growth_factor:   S is multiplied by this after `growth_interval` consecutive clean steps.
    backoff_factor:  S is multiplied by this when an overflow reaches the hysteresis.
    hysteresis:      consecutive overflows needed before backing off (1: every overflow).
    min_scale:       S never goes below this; an overflow there raises ScaleCollapseError.
    enabled:         False makes every method a pass-through (fp32 and bf16 runs).
    group:           the process group whose ranks must agree (default: the world).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = 1.0, enabled: bool = True, group=None):
        if not (0 < min_scale <= init_scale and _f32(init_scale) < float("inf")):
            raise ValueError(f"need 0 < min_scale <= init_scale <= fp32's largest (3.4e38), got "
                             f"min_scale={min_scale}, init_scale={init_scale}")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got "
                             f"{growth_factor} and {backoff_factor}")
        for name, v in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.enabled, self.group = float(min_scale), enabled, group
        self._scale = _f32(init_scale)
        self._growth_tracker = 0  # clean steps since the last overflow or growth
        self._overflow_streak = 0  # consecutive overflowing steps, up to now
        self._found_inf: dict[int, bool] = {}  # per optimizer, for the current step
        self._stepped: set[int] = set()
        self.skipped_steps = 0  # overflowing (skipped) steps over the whole run
        self.last_step_skipped = False

    # ---- the four calls of a training step ------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S (the loss stays fp32: autocast computes the loss in fp32)."""
        return loss * self._scale if self.enabled else loss

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by S in place and record whether any gradient, on
        any rank, is inf or NaN. Call once per optimizer step, after the gradient sync has
        finished (minidist.train.forward_backward returns then; a ZeRO optimizer's gradients
        are its shards', complete once its finish_gradient_synchronization() has run)."""
        if not self.enabled:
            return
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called for this optimizer since the last "
                               "update(): call it once per step, after all micro-steps")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError("fp16 gradients cannot be unscaled safely (1/S would underflow "
                             "them again): keep the parameters in fp32 and let autocast cast")
        device = grads[0].device if grads else params[0].device if params else torch.device("cpu")
        found = torch.zeros(1, device=device)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._scale)
            # not finite anywhere?  (inf stays inf and NaN stays NaN when divided by S)
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            found += (~finite).float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            # A rank that saw an overflow must not be the only one to skip: with sharded
            # gradients the others cannot see it. MAX makes the flag global (even a rank
            # with no gradients joins, so the collective always matches up).
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        self._found_inf[id(optimizer)] = bool(found.item())

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """optimizer.step() unless the gradients overflowed (then the parameters and the
        optimizer state are left untouched). Unscales first if unscale_ was not called."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() was already called for this optimizer since the last update()")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if self._found_inf[id(optimizer)]:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adjust S for the next step: back off on an overflow (once the streak reaches the
        hysteresis), grow after growth_interval clean steps. All optimizers stepped since
        the last update share one verdict: if any overflowed, the step overflowed."""
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("update() with no unscale_() or step() since the last update(): "
                               "there is no overflow verdict to act on")
        overflow = any(self._found_inf.values())
        if overflow and self._overflow_streak + 1 >= self.hysteresis and self._scale <= self.min_scale:
            raise ScaleCollapseError(  # raised before any state changes: the run stops here
                f"loss scale collapsed: gradients were inf/NaN on {self._overflow_streak + 1} "
                f"consecutive steps and the scale is already at min_scale={self.min_scale}. "
                "Scaling cannot fix gradients that overflow without amplification: the "
                "loss or activations themselves are non-finite, i.e. training is diverging. "
                "Try a lower learning rate (--lr), gradient clipping (--grad-clip), checking "
                "the data, or bf16 (--precision bf16), which has fp32's exponent range.")
        self._found_inf.clear()
        self._stepped.clear()
        self.last_step_skipped = overflow
        if overflow:
            self.skipped_steps += 1
            self._growth_tracker = 0
            self._overflow_streak += 1
            if self._overflow_streak >= self.hysteresis:
                self._scale = max(_f32(self._scale * self.backoff_factor), self.min_scale)
        else:
            self._overflow_streak = 0
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                # as GradScaler, never grow past what fp32 (the loss's dtype) can hold
                grown = _f32(self._scale * self.growth_factor)
                if grown <= FP32_MAX:
                    self._scale = grown
                self._growth_tracker = 0

    # ---- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "hysteresis": self.hysteresis, "min_scale": self.min_scale,
                "growth_tracker": self._growth_tracker, "overflow_streak": self._overflow_streak,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled:
            return
        if not state:
            raise RuntimeError("the state_dict is empty: it came from a disabled LossScaler")
        self._scale = float(state["scale"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self.hysteresis = state["growth_interval"], state["hysteresis"]
        self.min_scale = state["min_scale"]
        self._growth_tracker, self._overflow_streak = state["growth_tracker"], state["overflow_streak"]
        self.skipped_steps = state["skipped_steps"]
        self._found_inf.clear()  # a step in progress belongs to the old state
        self._stepped.clear()


def autocast(device: torch.device | str, precision: str):
    """The forward pass's autocast context for --precision fp32|bf16|fp16. Parameters stay
    fp32 (the master weights the optimizer updates); autocast casts them to the low
    precision for matmuls on the fly and keeps reductions like the loss in fp32."""
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtypes:
        raise ValueError(f"precision must be one of {sorted(dtypes)}, got {precision!r}")
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=dtypes[precision] or torch.float32,
                          enabled=dtypes[precision] is not None)
