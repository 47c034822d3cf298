"""Graded checks of exercise 09 (exercises/09_memory.py), registered with exercises.grade.

Every check runs in this process, on a small minidist GPT (3 blocks) whose blocks call the
implementation under test (`block.recompute = impl.checkpoint`). The oracle is the same
model, same weights, same batch, same seed, run without checkpointing: one forward and
backward, every parameter's gradient compared bit for bit (fp32 and bf16 alike: the
recomputation is the same arithmetic on the same inputs, so it gives the same bits).
The bytes saved for backward are counted from outside (minidist.memory.count_saved_bytes:
torch.autograd.graph.saved_tensors_hooks, deduplicated by storage, parameters left out)
and compared with a block's input, B x T x d fp32 numbers. While the implementation
runs, torch.utils.checkpoint's entry points are replaced by a tripwire: a solution that
calls it fails every check.
"""

from __future__ import annotations

import contextlib

import torch

from exercises import _rules
from exercises.grade import check
from minidist.memory import count_saved_bytes
from minidist.model import GPT, GPTConfig

B, T, D, V = 3, 16, 32, 64
RULE = "torch.utils.checkpoint is the oracle here, not a building block: write the Function yourself"
# its public functions, and what they call (looked up by name when they run); a solution
# that imported `checkpoint` before grading trips as well (exercises/_rules.py patches the
# function's code object)
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.recompute", "minidist.memory")
RULES = _rules.Rules(apis={f"torch.utils.checkpoint.{name}": RULE for name in (
    "checkpoint", "checkpoint_sequential", "_checkpoint_without_reentrant_generator")})


# tiered hints, gentlest first (python -m exercises.grade 09 --hint), by check function
HINTS = {
    "check_gradients": [
        "Pass the block's parameters to apply as inputs: F.apply(fn, x, *fn.__self__.parameters()); "
        "backward then returns one gradient per input of forward (None for fn).",
        "backward: x = x.detach().requires_grad_(); with torch.enable_grad(): y = ctx.fn(x); "
        "grads = torch.autograd.grad(y, [x, *params], grad_y, allow_unused=True); "
        "return (None, *grads).",
    ],
    "check_saved_bytes": [
        "Inside Function.forward autograd is off, so fn(x) records no graph; "
        "ctx.save_for_backward(x) is then the only thing kept.",
        "Calling fn(x) outside a Function, or saving fn's output or intermediates, keeps them all.",
    ],
    "check_dropout": [
        "In forward: ctx.rng = torch.get_rng_state() (and torch.cuda.get_rng_state(x.device) on a GPU).",
        "In backward: with torch.random.fork_rng(): torch.set_rng_state(ctx.rng); then recompute. "
        "fork_rng puts the run's own stream back afterwards.",
    ],
    "check_autocast": [
        "Backward runs outside the forward's torch.autocast block: record the state in forward.",
        "kind = x.device.type; ctx.amp = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)); "
        "in backward: with torch.autocast(kind, dtype=dtype, enabled=on): recompute.",
    ],
}


@contextlib.contextmanager
def _forbid_torch_checkpoint():
    """The learner's code runs here; a call of torch.utils.checkpoint fails the check,
    even when the solution catches the exception."""
    with _rules.watching(RULES) as w:
        try:
            yield
        except Exception:
            if not w.broken:
                raise
    if w.broken:
        raise AssertionError(w.broken[0])


def _model(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=D, block_size=T, vocab_size=V, dropout=dropout))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _grads(model, fn, precision="fp32"):
    """Every gradient of one forward and backward, and the next random numbers."""
    for b in model.blocks:
        b.recompute = fn
    model.zero_grad(set_to_none=True)
    x, y = _batch()
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        _, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    return grads, torch.rand(4)


def _compare(impl, dropout=0.0, precision="fp32", what="") -> None:
    model = _model(dropout)
    want, rng_want = _grads(model, None, precision)
    with _forbid_torch_checkpoint():
        got, rng_got = _grads(model, impl.checkpoint, precision)
    for name, g in want.items():
        if got[name] is None:
            raise AssertionError(f"{name} got no gradient: return the parameters' gradients from "
                                 "backward (the parameters must be inputs of the Function's apply)")
        if not torch.equal(g, got[name]):
            diff = (g - got[name]).abs().max().item()
            raise AssertionError(f"{name}'s gradient differs from the run without checkpointing "
                                 f"by up to {diff:.3g}{what}")
    if not torch.equal(rng_want, rng_got):
        raise AssertionError("the random numbers drawn after the step differ from the run without "
                             "checkpointing: restore the RNG inside torch.random.fork_rng(), which "
                             "puts the run's own stream back when it ends")


@check("09", 2, "gradients equal the run without checkpointing (fp32, exactly)")
def check_gradients(impl):
    _compare(impl)


@check("09", 2, "memory: each block keeps only its input for backward")
def check_saved_bytes(impl):
    model = _model()
    for b in model.blocks:
        b.recompute = impl.checkpoint
    x, y = _batch()
    with _forbid_torch_checkpoint():
        saved = count_saved_bytes(model, x, y)["blocks"]
    want = B * T * D * 4  # the block's input, fp32
    for i, got in enumerate(saved):
        if got > want:
            raise AssertionError(f"block {i} kept {got} bytes for backward, {got / want:.1f} times its "
                                 f"input ({want} bytes): run fn under torch.no_grad() in forward and "
                                 "save only x")
        if got < want:
            raise AssertionError(f"block {i} kept {got} bytes for backward, less than its input "
                                 f"({want} bytes): backward needs x to recompute the block")
    _compare(impl, what=" (the memory check needs right gradients too)")


@check("09", 2, "dropout: the recomputed forward draws the same random numbers")
def check_dropout(impl):
    _compare(impl, dropout=0.2, what=" with dropout on: save the RNG state in forward and set it "
             "back before recomputing")


@check("09", 2, "autocast: recomputed at the forward's precision (bf16)")
def check_autocast(impl):
    _compare(impl, precision="bf16", what=" under bf16 autocast: record the autocast state in "
             "forward and re-enter it to recompute")
