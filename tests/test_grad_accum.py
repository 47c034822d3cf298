"""Gradient accumulation with token-weighted loss (minidist.train.forward_backward): ranks x
micro-steps with masked targets of unequal counts give the gradient of one process on the
whole batch, where every unmasked token weighs the same. The ranks come from the session's
process pools (tests/conftest.py), the model, batch and oracle from tests/helpers.py."""

import pytest
import torch
import torch.distributed as dist

from helpers import micro_batches, one_process, tiny_gpt, token_batch
from minidist.ddp import DDP, allreduce_gradients_flat
from minidist.train import forward_backward

T, B, K = 12, 8, 2  # global batch of 8 sequences of 12 tokens; K micro-steps


def _batch():
    return token_batch(0, B, T, 64, masked=True)  # sequence i keeps 12 - i - 1 targets


def _one_process_grads():
    return one_process(tiny_gpt(block_size=T), [_batch()])  # mean over all unmasked tokens


def _accumulated_grads(use_ddp):
    r, n = dist.get_rank(), dist.get_world_size()
    m = tiny_gpt(block_size=T)
    micro = micro_batches(*_batch(), r, n, K)
    ddp = DDP(m, bucket_cap_mb=0) if use_ddp else None
    loss = forward_backward(ddp or m, micro, n, ddp)
    if ddp is None:
        allreduce_gradients_flat(m)
    return {name: p.grad.clone() for name, p in m.named_parameters()}, loss


@pytest.mark.parametrize("world, use_ddp", [(1, False), (2, True), (2, False), (4, True)])
def test_accumulation_with_masks_equals_one_big_batch(world, use_ddp, pool):
    ref = _one_process_grads()
    assert len({int((y != -1).sum()) for _, y in micro_batches(*_batch(), 0, world, K)}) > 1
    for grads, _ in pool(world).run(_accumulated_grads, use_ddp):
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_per_micro_batch_mean_would_be_wrong():
    """The check above can fail: averaging per-micro-batch means (the common mistake)
    weighs the tokens of short micro-batches more, and gives a different gradient."""
    m = tiny_gpt(block_size=T)
    x, y = _batch()
    for j in range(K):
        sl = slice(j * B // K, (j + 1) * B // K)
        (m(x[sl], y[sl])[1] / K).backward()
    ref = _one_process_grads()
    assert not torch.allclose(m.wte.weight.grad, ref["wte.weight"], rtol=1e-3)


def test_the_target_count_is_exact_and_a_batch_with_nothing_to_learn_is_refused():
    """target_count, shared by forward_backward and both pipeline steps: this rank's own count
    (no groups) is the unmasked targets, in float64; all masked is a ValueError, before any
    backward."""
    from minidist.train import target_count
    x, y = _batch()
    assert target_count([(x[:3], y[:3]), (x[3:], y[3:])], ()).item() == (y != -1).sum().item()
    assert target_count([(x, y)], ()).dtype == torch.float64
    with pytest.raises(ValueError, match="every target in this global batch is masked"):
        target_count([(x, torch.full_like(y, -1))], ())
