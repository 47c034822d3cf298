"""Exercise 09: activation checkpointing.

Chapter 09 (chapters/09_memory.md) counts what a transformer block keeps for its backward:
about 16 x batch x sequence x width numbers (in fp32, 64 bytes a token a unit of width),
where the block's input alone is 4 bytes a token a unit of width. Checkpointing keeps
only the input, and recomputes the block when backward reaches it.

Implement `checkpoint(fn, x)`:

    y = checkpoint(fn, x)        # y equals fn(x); backward gives the gradients fn(x) would

`fn` is a transformer block's forward (a bound method, such as `block._forward` of a
minidist.model.Block; `fn.__self__` is the block, whose `.parameters()` are the weights it
uses); `x` is the block's input, a tensor that requires grad. The model calls it for
every block once you set `block.recompute = checkpoint` (the grader does). How you build
it is yours to design (chapter 09, section 2, explains the idea).

The contract (each a part of the score):
- gradients: after backward, x's gradient and every parameter's gradient equal those of
  the run without checkpointing, exactly (fp32, no dropout: the same arithmetic gives the
  same bits), reaching .grad through the ordinary backward;
- memory: between forward and backward a block keeps only its input for backward. The
  grader runs each block alone and looks where memory really is: it walks the autograd
  graph behind the block's output (every node's saved tensors and everything a custom
  Function's context holds) and every tensor made during the call that is still alive,
  anywhere; the parameters, the output and a random generator's state do not count;
- dropout: with dropout on, the gradients equal the run without checkpointing (the
  recomputation sees the same dropout masks), and the random numbers drawn after the
  step are those the run without checkpointing draws;
- autocast: under torch.autocast(bf16) the gradients equal the run without
  checkpointing (backward runs outside the forward's autocast region).

Rules: torch.utils.checkpoint is the oracle, not a building block: none of it (its
functions, its Function classes) may be named in your file, and all of it trips while
your code runs; a solution that uses it scores 0. What you keep for backward stays in
tensors, where the grader counts it: no bare storages, numpy arrays, lists or bytes.

Grade your work with

    python -m exercises.grade 09

and see what full marks look like with `python -m exercises.grade 09 --reference`, which
grades minidist's own (minidist/memory/recompute.py) instead of yours.
"""

from __future__ import annotations

import torch  # noqa: F401 - for you


def checkpoint(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), keeping only x for backward and recomputing fn in backward."""
    raise NotImplementedError(
        "checkpoint is not written yet: the contract is in the docstring of exercises/"
        "09_memory.py (chapter 09, section 2). `python -m exercises.grade 09 --hint` shows "
        "hints, one at a time.")


# Where minidist implements it; `python -m exercises.grade 09 --reference` grades this
# instead of the stub above. Leave it as it is.
REFERENCE = {"checkpoint": "minidist.memory.recompute:checkpoint"}
