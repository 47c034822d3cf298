"""The gradient-sync interface: one base class for everything that averages gradients.
Chapter 03 (chapters/03_data_parallel.md), section "One interface for every way of
averaging". Exercised by tests/test_ddp.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@torch.no_grad()
def clip_to_global_norm(square_sum: torch.Tensor, max_norm: float, scale_grads) -> torch.Tensor:
    """The one global-norm clip every gradient sync shares: given the whole gradient's
    squared norm (the same number on every rank), multiply the gradients by
    min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ does, through
    `scale_grads(coef)`; return the norm before clipping."""
    norm = torch.as_tensor(square_sum, dtype=torch.float64).reshape(()).sqrt().float()
    scale_grads((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


class GradientSync:
    """Whatever averages the gradients (DDP's three forms, ZeRO 1-3, the mesh and pipeline
    syncs), the training loop talks to it through three calls, so it never asks which:

        with sync.no_sync(): ...                 micro-steps whose backward does not communicate
        sync.finish_gradient_synchronization()   after the last backward: gradients averaged
        sync.clip_grad_norm_(max_norm)           then: clip by the whole averaged gradient's norm

    A subclass writes finish_gradient_synchronization and the two calls clipping is built
    from: grad_square_sum(weight) (the whole gradient's squared norm, float64, the same on
    every rank of the sync's group; each parameter's squares times weight(p) if given, which
    is how the mesh counts a tensor-parallel shard once) and scale_grads(coef) (this rank's
    gradients times coef). no_sync() does nothing unless backward would communicate."""

    @contextmanager
    def no_sync(self):
        yield

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def grad_square_sum(self, weight=None) -> torch.Tensor:
        raise NotImplementedError

    def scale_grads(self, coef) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the averaged gradient (after
        finish_gradient_synchronization()); returns the norm before clipping."""
        return clip_to_global_norm(self.grad_square_sum(), max_norm, self.scale_grads)
