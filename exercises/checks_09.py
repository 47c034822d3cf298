"""Graded checks of exercise 09 (exercises/09_memory.py), registered with exercises.grade.

Every check runs in this process, on a small minidist GPT (3 blocks) whose blocks call the
implementation under test (`block.recompute = impl.checkpoint`). The oracle is the same
model, same weights, same batch, same seed, run without checkpointing: one forward and
backward, every parameter's gradient compared bit for bit (fp32 and bf16 alike: the
recomputation is the same arithmetic on the same inputs, so it gives the same bits).

What a block keeps for backward is found where it really is (exercises/_measure.py), not
counted by hooks learner code could stack its own under: each block runs alone on an
input that requires grad, and the grader walks the autograd graph behind its output
(every node's saved tensors, unpacked through whatever hooks were in force, and all a
custom Function's ctx holds) and every tensor object that came alive during the call and
is still alive; parameters, the output and RNG states left out. It must be the input,
B x T x d fp32 numbers. While the implementation runs, torch.utils.checkpoint's entry
points are replaced by a tripwire: a solution that calls it fails every check.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from exercises import _measure, _rules
from exercises.grade import check
from minidist.model import GPT, GPTConfig

B, T, D, V = 3, 16, 32, 64
RULE = "torch.utils.checkpoint is the oracle here, not a building block: write the Function yourself"
# its public functions, and what they call (looked up by name when they run); a solution
# that imported `checkpoint` before grading trips as well (exercises/_rules.py patches the
# function's code object)
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.memory.recompute", "minidist.memory")
RULES = _rules.Rules(apis={api: RULE for api in _rules.defined_in(torch.utils.checkpoint)})
# read before anything runs: all of torch.utils.checkpoint (its Functions too), and the
# ways to keep an activation where no tensor count sees it (bare storages, numpy, bytes)
FILE_RULES = {"torch.utils.checkpoint": RULE}
_HIDDEN = ("checkpoint keeps its activations as tensors, where the grader counts them: no bare "
           "storages, numpy arrays, Python lists or bytes")
FILE_ATTRS = {a: _HIDDEN for a in ("untyped_storage", "storage", "_typed_storage", "set_", "numpy",
                                   "tolist", "tobytes", "frombuffer", "data_ptr", "UntypedStorage",
                                   "TypedStorage", "from_file")}


# tiered hints, gentlest first (python -m exercises.grade 09 --hint), by check function
HINTS = {
    "check_gradients": [
        "A torch.autograd.Function gives you both halves: a forward that may run fn with "
        "autograd off, and a backward that may run it again with autograd on. Gradients "
        "reach parameters through backward only if they are inputs of the Function's apply.",
        "In backward, recompute from a detached copy of the saved input that requires grad, "
        "with autograd on, and differentiate the recomputed output with respect to that "
        "copy and to the parameters (torch.autograd.grad); backward returns one gradient "
        "per input of forward.",
    ],
    "check_saved_bytes": [
        "With autograd off, fn(x) records no graph; what your Function saves for backward "
        "is then the only thing kept.",
        "Calling fn(x) outside a Function, or keeping fn's output or intermediates (saved, "
        "on ctx, or anywhere else), keeps them all: the grader looks at the graph and at "
        "every tensor left alive.",
    ],
    "check_dropout": [
        "Dropout draws from the random stream: the recomputation must start from the state "
        "the forward started from.",
        "Keep the generator's state in forward; in backward set it back for the "
        "recomputation only, so that the run's own stream is where it was afterwards "
        "(torch.random.fork_rng restores it on exit).",
    ],
    "check_autocast": [
        "Backward runs outside the forward's torch.autocast block: record the state in "
        "forward.",
        "torch.is_autocast_enabled and torch.get_autocast_dtype, for the input's device "
        "type, say what forward ran under; recompute under the same torch.autocast.",
    ],
}


@contextlib.contextmanager
def _forbid_torch_checkpoint():
    """The learner's code runs here; a call of torch.utils.checkpoint fails the check,
    even when the solution catches the exception."""
    with _rules.refusing(RULES):
        yield


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


def _kept(impl, block, x) -> tuple[int, str]:
    """(bytes, what): what block `block` keeps for backward once checkpoint(fn, x) has
    returned, found where it really is (exercises/_measure.py): every tensor the autograd
    graph behind the output holds (the nodes' saved tensors, unpacked through whatever
    hooks were in force, and everything a custom Function's ctx holds), and every tensor
    object that came alive during the call and is still alive (stashed anywhere else), the
    output itself, the parameters and the RNG states left out."""
    mods = {getattr(impl.checkpoint, "__module__", None)}
    params = _measure.storages(block.parameters())
    before = {k for k, _ in [_measure.key(x)]} | params
    with _measure.born_during() as new, _forbid_torch_checkpoint():
        out = impl.checkpoint(block._forward, x)
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"checkpoint(fn, x) returned {type(out).__name__}, want fn(x), a tensor")
    saved = _measure.graph_saved(out, modules=mods) if out.grad_fn is not None else {}
    mine = _measure.key(out)[0]
    kept = {k: v for k, v in saved.items() if k not in params and not _measure.is_rng_state(v[1])}
    stashed = {k: v for k, v in new.tensors.items() if k not in before and k != mine
               and k not in kept and not _measure.is_rng_state(v[1])}
    graph, elsewhere = _measure.total(kept), _measure.total(stashed)
    what = (f"{graph} bytes held by the autograd graph" if not elsewhere else
            f"{graph} bytes held by the autograd graph and {elsewhere} more alive elsewhere "
            "(tensors made during the call and kept somewhere other than the graph)")
    del out
    return graph + elsewhere, what


@check("09", 2, "memory: each block keeps only its input for backward")
def check_saved_bytes(impl):
    model = _model()
    want = B * T * D * 4  # the block's input, fp32
    g = torch.Generator().manual_seed(3)
    for i, block in enumerate(model.blocks):
        x = torch.randn(B, T, D, generator=g, requires_grad=True)
        got, what = _kept(impl, block, x)
        if got > want:
            raise AssertionError(f"block {i} keeps {got} bytes for backward ({what}), {got / want:.1f} "
                                 f"times its input ({want} bytes): keep only x (the grader walks "
                                 "the graph behind the output and every tensor left alive)")
        if got < want:
            raise AssertionError(f"block {i} keeps {got} bytes for backward ({what}), less than its "
                                 f"input ({want} bytes): backward needs x to recompute the block")
    _compare(impl, what=" (the memory check needs right gradients too)")


@check("09", 2, "dropout: the recomputed forward draws the same random numbers")
def check_dropout(impl):
    _compare(impl, dropout=0.2, what=" with dropout on: save the RNG state in forward and set it "
             "back before recomputing")


@check("09", 2, "autocast: recomputed at the forward's precision (bf16)")
def check_autocast(impl):
    _compare(impl, precision="bf16", what=" under bf16 autocast: record the autocast state in "
             "forward and re-enter it to recompute")
