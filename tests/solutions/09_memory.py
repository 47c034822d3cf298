"""Exercise 09: activation checkpointing (recomputation).

A transformer block keeps about 16 x batch x sequence x width numbers for its backward
(64 bytes a token a unit of width, in fp32); its input alone is 4. Checkpointing keeps
only the input, and runs the block's forward again when backward reaches it. Read
chapters/09_memory.md, section 2 "Recomputation" (section 1 counts what a block keeps).

Write `checkpoint(fn, x)`:

    y = checkpoint(fn, x)        # y equals fn(x); backward gives the gradients fn(x) would

`fn` is a transformer block's forward, a bound method such as `block._forward` of a
minidist.model.Block (`fn.__self__` is the block, whose `.parameters()` are the weights it
uses); `x` is the block's input, a tensor that requires grad. The model calls it for every
block once `block.recompute = checkpoint` is set (the grader sets it).

What is graded (the oracle: the same model, weights, batch and seed, run without it):
- gradients: every parameter's gradient equals the run without checkpointing, exactly
  (fp32, no dropout), reaching .grad through the ordinary backward
- memory: between forward and backward each block keeps only its input: the grader walks
  the autograd graph behind the output (every node's saved tensors, everything a custom
  Function's context holds) and every tensor made during the call and still alive; the
  parameters, the output and a random generator's state do not count
- dropout: with dropout on, the gradients equal the run without checkpointing, and the
  random numbers drawn after the step are those that run draws
- autocast: under torch.autocast(bf16) the gradients equal the run without checkpointing

Rule: no torch.utils.checkpoint (checkpoint, checkpoint_sequential) (see the README, "Exercises and grading").

Grade your work with `python -m exercises.grade 09`, ask for a hint on the first failing
check with `python -m exercises.grade 09 --hint`, and see what full marks look like with
`python -m exercises.grade 09 --reference` (minidist/memory/recompute.py).
"""

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
