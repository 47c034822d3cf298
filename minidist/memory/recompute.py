"""Activation checkpointing (recomputation), written on torch.autograd.Function. Chapter 09
(chapters/09_memory.md). Exercised by:

    python minidist/train_gpt.py --steps 20 --activation-checkpointing blocks
    pytest tests/test_memory.py

`checkpoint(fn, x)` keeps only `x`; the backward runs `fn` again with autograd on and
differentiates that. The second forward is the same computation because the RNG states and
the autocast state are saved and re-entered. The block's parameters are inputs of the
Function and the backward returns their gradients, so they reach `.grad` through the outer
backward: DDP's and ZeRO's post-accumulate-grad hooks fire in the order they expect.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = (device, torch.cuda.get_rng_state(device))
    return state


def _autocast_state(device_type: str) -> dict:
    """Whether autocast is on for this device (and the CPU, which a CUDA run may also
    autocast), at which dtype: what the recomputation must re-enter."""
    kinds = {device_type, "cpu"}
    return {k: (torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds}


@contextlib.contextmanager
def _replay(rng: dict, amp: dict):
    """Inside: the RNG as it was when the forward started, and its autocast state. On
    leaving, the RNG goes back to where the training run had it (fork_rng)."""
    devices = [rng["cuda"][0]] if "cuda" in rng else []
    with torch.random.fork_rng(devices=devices, enabled=True, device_type="cuda"):
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"][1], rng["cuda"][0])
        with contextlib.ExitStack() as stack:
            for kind, (on, dtype) in amp.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=on))
            yield


class Checkpoint(torch.autograd.Function):
    """y = fn(x), keeping only x (and the RNG and autocast states) for backward."""

    @staticmethod
    def forward(ctx, fn, x, *params):
        ctx.fn, ctx.n_params = fn, len(params)
        ctx.rng, ctx.amp = _rng_state(x.device), _autocast_state(x.device.type)
        ctx.save_for_backward(x)  # the only tensor kept (params are the model's own)
        with torch.no_grad():  # autograd is already off here; say so for the reader
            return fn(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        params = [p for p in _params(ctx.fn)]
        x = x.detach().requires_grad_(True)  # a leaf of the recomputed graph
        with _replay(ctx.rng, ctx.amp), torch.enable_grad():
            y = ctx.fn(x)
        # gradients of x and of the parameters that took part; the outer backward
        # accumulates them into .grad (None for a parameter the block did not use)
        want = [x] + [p for p in params if p.requires_grad]
        grads = iter(torch.autograd.grad(y, want, grad_y, allow_unused=True))
        gx = next(grads)
        gp = [next(grads) if p.requires_grad else None for p in params]
        return (None, gx, *gp)


def _params(fn) -> list[nn.Parameter]:
    """The parameters `fn` uses: a module's, or a bound method's module's."""
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return list(owner.parameters()) if isinstance(owner, nn.Module) else []


def checkpoint(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), recomputed in backward instead of stored. `fn` is a module, or a bound
    method of one (its parameters are found from it); its only tensor input is x."""
    if not torch.is_grad_enabled():  # no backward will come: nothing to save, nothing to do
        return fn(x)
    return Checkpoint.apply(fn, x, *_params(fn))


def set_activation_checkpointing(model: nn.Module, on: bool = True) -> None:
    """Recompute every transformer block of a minidist GPT in backward (or stop). Each Block
    calls its `recompute` attribute around its own forward, inside the module's hooks, so
    ZeRO-3's gather of a block's parameters comes before the recomputation that needs them."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError("activation checkpointing works per transformer block: the model "
                         "needs a `blocks` list (minidist.model.GPT has one)")
    for b in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):  # a pipeline Stage's
        b.recompute = checkpoint if on else None
