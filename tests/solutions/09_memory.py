"""Exercise 09 solved the way chapter 09 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

import torch  # noqa: F401


class _Recompute(torch.autograd.Function):
    """y = fn(x), keeping only x (and the RNG and autocast states) for backward."""

    @staticmethod
    def forward(ctx, fn, x, *params):
        ctx.fn = fn
        ctx.rng = torch.get_rng_state()
        kind = x.device.type
        ctx.amp = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x)
        return fn(x)  # autograd is off inside a Function's forward: no graph is kept

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        params = list(ctx.fn.__self__.parameters())
        kind, enabled, dtype = ctx.amp
        with torch.random.fork_rng():  # the run's own stream is restored on leaving
            torch.set_rng_state(ctx.rng)
            with torch.autocast(kind, dtype=dtype, enabled=enabled), torch.enable_grad():
                y = ctx.fn(x)
        grads = torch.autograd.grad(y, [x, *params], grad_y, allow_unused=True)
        return (None, *grads)


def checkpoint(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), keeping only x for backward and recomputing fn in backward."""
    return _Recompute.apply(fn, x, *fn.__self__.parameters())


# Where minidist implements it; `python -m exercises.grade 09 --reference` grades this
# instead of the stub above. Leave it as it is.
REFERENCE = {"checkpoint": "minidist.memory.recompute:checkpoint"}
