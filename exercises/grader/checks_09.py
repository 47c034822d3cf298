"""Graded checks of exercise 09 (exercises/09_memory.py).

One process, a small minidist GPT whose blocks call the implementation under test. The
oracle is the same model, weights, batch and seed run without it: every gradient bit for
bit, and the random numbers drawn afterwards. What a block keeps for backward is found
where it is (memory.py): the autograd graph behind its output, and every tensor made
during the call and still alive (parameters, output and generator states left out).
"""

import gc

import torch

from exercises.grader import Rules, check, differ, first_problem
from exercises.grader import memory as M
from minidist.model import GPT, GPTConfig

B, T, D, V = 3, 16, 32, 64
_INSTEAD = "torch.utils.checkpoint is the oracle here, not a building block: write the Function yourself"
RULES = Rules(forbidden={f"torch.utils.checkpoint:{name}": _INSTEAD
                         for name in ("checkpoint", "checkpoint_sequential")})


def _model(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=D, block_size=T, vocab_size=V, dropout=dropout))


def _grads(model: GPT, fn, bf16: bool) -> tuple[dict, torch.Tensor]:
    """Every parameter's gradient after one forward and backward, and the next random numbers."""
    for b in model.blocks:
        b.recompute = fn
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, loss = model(x, y)
    loss.backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}, torch.rand(4)


def _compare(impl, dropout: float = 0.0, bf16: bool = False, what: str = "") -> None:
    model = _model(dropout)
    got, rng_got = _grads(model, impl.checkpoint, bf16)
    want, rng_want = _grads(model, None, bf16)
    first_problem(differ(f"{name}'s gradient{what}", got[name], w, "the run without checkpointing's", 0, 0)
                  for name, w in want.items())  # bit for bit
    assert torch.equal(rng_want, rng_got), (
        f"the random numbers drawn after the step{what} differ from those drawn after the run "
        f"without checkpointing: {rng_got.tolist()} instead of {rng_want.tolist()}")


@check("09", 2, "gradients equal the run without checkpointing (fp32, exactly)", hints=[
    "Which part of torch lets you write both the forward and the backward of one operation?",
    "A torch.autograd.Function: its forward may run fn with autograd off, its backward may run "
    "fn again with autograd on. Gradients reach the parameters only if they are inputs of apply.",
    "In backward, recompute from a detached copy of the saved input that requires grad, and "
    "differentiate the recomputed output with respect to that copy and the parameters "
    "(torch.autograd.grad); backward returns one gradient per input of forward.",
])
def _gradients(impl):
    _compare(impl)


def _kept(impl, block, x) -> tuple[int, str]:
    """(bytes, where) that checkpoint(block._forward, x) keeps for backward, the parameters,
    x, the output and generator states left out."""
    params = M.storages(block.parameters())
    before = {M.key(x)[0]} | params
    with M.born_during() as new:
        out = impl.checkpoint(block._forward, x)
    assert isinstance(out, torch.Tensor), f"checkpoint(fn, x) returned {type(out).__name__}, want a tensor"
    mods = {getattr(impl.checkpoint, "__module__", None)}
    saved = M.graph_saved(out, modules=mods) if out.grad_fn is not None else {}
    mine = M.key(out)[0]
    kept = {k: v for k, v in saved.items() if k not in params and not M.is_rng_state(v[1])}
    stashed = {k: v for k, v in new.tensors.items() if k not in before and k != mine
               and k not in kept and not M.is_rng_state(v[1])}
    graph, elsewhere = M.total(kept), M.total(stashed)
    where = f"{graph} bytes in the autograd graph" + (
        f" and {elsewhere} more in tensors made during the call and still alive elsewhere"
        if elsewhere else "")
    return graph + elsewhere, where


@check("09", 2, "memory: each block keeps only its input for backward", hints=[
    "What does the autograd graph keep when fn(x) runs with autograd on, and when it runs off?",
    "With autograd off, fn(x) records no graph: what your Function saves for backward is then "
    "all that is kept. Keep neither fn's output nor its intermediates, anywhere.",
])
def _memory(impl):
    model = _model()
    g = torch.Generator().manual_seed(3)
    gc.freeze()  # what lives now is no block's activation: the collections below skip it
    try:
        for i, block in enumerate(model.blocks):
            x = torch.randn(B, T, D, generator=g, requires_grad=True)
            want = M.key(x)[1]  # the block's input
            plain = M.total({k: v for k, v in M.graph_saved(block(x)).items()
                             if k not in M.storages(block.parameters())})
            got, where = _kept(impl, block, x)
            assert got == want, (f"block {i} keeps {got} bytes for backward ({where}); its input is "
                                 f"{want} bytes, and without checkpointing it keeps {plain}")
    finally:
        gc.unfreeze()
    _compare(impl, what=" (the memory check needs right gradients too)")


@check("09", 2, "dropout: the recomputed forward draws the same random numbers", hints=[
    "Where does dropout get its masks, and where is that source when backward recomputes?",
    "Keep the generator's state in forward; in backward set it back for the recomputation "
    "only, so that the run's own stream is where it was afterwards (torch.random.fork_rng).",
])
def _dropout(impl):
    _compare(impl, dropout=0.2, what=" with dropout 0.2")


@check("09", 2, "autocast: recomputed at the forward's precision (bf16)", hints=[
    "Backward does not run inside the forward's torch.autocast block: what does the "
    "recomputation run at?",
    "torch.is_autocast_enabled and torch.get_autocast_dtype, for the input's device type, say "
    "what forward ran under; record them, and recompute under the same torch.autocast.",
])
def _autocast(impl):
    _compare(impl, bf16=True, what=" under bf16 autocast")
