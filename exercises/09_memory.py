"""Exercise 09: activation checkpointing, written on torch.autograd.Function.

Chapter 09 (chapters/09_memory.md) counts what a transformer block keeps for its backward:
about 16 x batch x sequence x width numbers (in fp32, 64 bytes a token a unit of width),
where the block's input alone is 4 bytes a token a unit of width. Checkpointing keeps
only the input, and recomputes the block when backward reaches it.

Implement `checkpoint(fn, x)`:

    y = checkpoint(fn, x)        # y equals fn(x); backward gives the gradients fn(x) would

`fn` is a transformer block's forward (a bound method, such as `block._forward` of a
minidist.model.Block; `fn.__self__` is the block, whose `.parameters()` are the weights it
uses); `x` is the block's input, a tensor that requires grad. The model calls it for
every block once you set `block.recompute = checkpoint` (the grader does).

Write a torch.autograd.Function whose forward runs fn with autograd off and saves only x;
whose backward runs fn again with autograd on, on a detached copy of x that requires
grad, and differentiates it (torch.autograd.grad) with respect to x and the block's
parameters; pass the parameters to the Function's apply as inputs, so that the gradients
it returns for them reach their .grad through the ordinary backward.

What the grader checks (each a part of the score):
- gradients: every parameter's gradient equals the run without checkpointing, exactly
  (fp32, no dropout: the same arithmetic gives the same bits);
- memory: the bytes saved for backward, counted from outside with
  torch.autograd.graph.saved_tensors_hooks, are per block those of its input only;
- dropout: with dropout on, the recomputed forward draws the same random numbers as the
  first (save the RNG state in forward: torch.get_rng_state(), and on a GPU
  torch.cuda.get_rng_state(); set it back before recomputing, inside
  torch.random.fork_rng() so the training run's own stream is left where it was);
- autocast: under torch.autocast(bf16) the gradients equal the run without checkpointing
  (backward runs outside the forward's autocast region: record torch.is_autocast_enabled
  and torch.get_autocast_dtype for the device in forward, and re-enter them to recompute).

Rule: torch.utils.checkpoint is the oracle, not a building block. The grader replaces it
with a tripwire while your code runs; a solution that calls it scores 0.

Grade your work with

    python -m exercises.grade 09

and see what full marks look like with `python -m exercises.grade 09 --reference`, which
grades minidist's own (minidist/recompute.py) instead of yours.
"""

from __future__ import annotations

import torch  # noqa: F401 - for you: torch.autograd.Function, torch.random.fork_rng


def checkpoint(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), keeping only x for backward and recomputing fn in backward."""
    raise NotImplementedError(
        "checkpoint: a torch.autograd.Function whose forward saves only x (and the RNG and "
        "autocast states) and whose backward recomputes fn(x) and differentiates it; chapter "
        "09, section 2. `python -m exercises.grade 09 --hint` shows hints, one at a time.")


# Where minidist implements it; `python -m exercises.grade 09 --reference` grades this
# instead of the stub above. Leave it as it is.
REFERENCE = {"checkpoint": "minidist.recompute:checkpoint"}
