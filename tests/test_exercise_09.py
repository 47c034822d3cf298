"""Exercise 09's grader: the stub scores 0, minidist full, a solution written as the
exercise asks full, one that calls torch.utils.checkpoint 0, and each classic mistake
loses the points of its checks only."""

import contextlib

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint as imported_early  # before the tripwire

from exercises import grade as G
from grading_helpers import assert_keys_name_each_check_once, failed_checks

CHECK9 = {"grads": "gradients equal", "memory": "memory:", "dropout": "dropout:", "autocast": "autocast:"}


def _solution(restore_rng=True, replay_autocast=True, keep_graph=False):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fn, x, *params):
            ctx.fn, ctx.rng = fn, torch.get_rng_state()
            kind = x.device.type
            ctx.amp = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            ctx.save_for_backward(x)
            return fn(x)

        @staticmethod
        def backward(ctx, gy):
            (x,) = ctx.saved_tensors
            x = x.detach().requires_grad_()
            params = list(ctx.fn.__self__.parameters())
            kind, on, dtype = ctx.amp
            with torch.random.fork_rng():
                if restore_rng:
                    torch.set_rng_state(ctx.rng)
                amp = torch.autocast(kind, dtype=dtype, enabled=on) if replay_autocast else contextlib.nullcontext()
                with amp, torch.enable_grad():
                    y = ctx.fn(x)
            return (None, *torch.autograd.grad(y, [x, *params], gy, allow_unused=True))

    def checkpoint(fn, x):
        if keep_graph:  # no Function at all: right gradients, every activation kept
            return fn(x)
        return F.apply(fn, x, *fn.__self__.parameters())
    return checkpoint


def _uses_torch(fn, x):
    return torch_checkpoint.checkpoint(fn, x, use_reentrant=False)


def _uses_torch_imported_early(fn, x):
    return imported_early(fn, x, use_reentrant=False)


MISTAKES = {  # name: (implementation, the checks that must fail)
    "no RNG restore": (_solution(restore_rng=False), {"dropout"}),
    "no autocast replay": (_solution(replay_autocast=False), {"autocast"}),
    "keeps the whole graph": (_solution(keep_graph=True), {"memory"}),
}


def _grade(fn):
    return G.grade("09", overrides={"checkpoint": fn})


def test_09_check_keys_name_each_check_once():
    assert_keys_name_each_check_once("09", CHECK9)


def test_09_stub_scores_zero_and_reference_full():
    stub, ref = G.grade("09"), G.grade("09", reference=True)
    assert stub.points == 0 and all(c.message.startswith("not implemented: ") for c in stub.checks)
    assert ref.points == ref.max_points > 0, {c.name: c.message for c in ref.checks if not c.ok}


def test_09_a_plain_solution_scores_full():
    r = _grade(_solution())
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


def _tries_torch_then_its_own(fn, x):  # swallows the tripwire: still caught
    try:
        return torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    except Exception:
        return _solution()(fn, x)


@pytest.mark.parametrize("fn", [_uses_torch, _uses_torch_imported_early, _tries_torch_then_its_own],
                         ids=["module", "imported", "swallowed"])
def test_09_torch_checkpoint_scores_zero(fn):
    r = _grade(fn)
    assert r.points == 0
    assert all("torch.utils.checkpoint is the oracle" in c.message and "forbids" in c.message for c in r.checks)
    x = torch.ones(1, requires_grad=True)
    assert torch_checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=False).item() == 2  # restored


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_09_mistake_loses_the_points_of_its_checks(mistake):
    fn, must_fail = MISTAKES[mistake]
    r = _grade(fn)
    which, messages = failed_checks(r, CHECK9)
    assert which == must_fail, messages
    assert 0 < r.points < r.max_points
