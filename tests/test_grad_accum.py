"""Gradient accumulation with token-weighted loss (minidist.train.forward_backward): ranks x
micro-steps with masked targets of unequal counts give the gradient of one process on the
whole batch, where every unmasked token weighs the same."""

import pytest
import torch
import torch.distributed as dist

from minidist.ddp import DDP, allreduce_gradients_flat
from minidist.launch import launch
from minidist.model import GPT, GPTConfig
from minidist.train import forward_backward

CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=12, vocab_size=64)
B, K = 8, 2  # global batch of 8 sequences; K micro-steps


def _batch():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 64, (B, 12), generator=g)
    y = torch.randint(0, 64, (B, 12), generator=g)
    # mask a different number of targets in each sequence (sequence i keeps 12 - i - 1)
    for i in range(B):
        y[i, 12 - i - 1:] = -1
    return x, y


def _one_process_grads():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG))
    x, y = _batch()
    m(x, y)[1].backward()  # mean over all unmasked tokens of the whole batch
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _accumulated_grads(use_ddp):
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG))
    x, y = _batch()
    per = B // (n * K)
    # micro-step j of rank r takes sequences [(j * n + r) * per, ...), as TokenLoader does
    micro = [(x[(j * n + r) * per:(j * n + r + 1) * per], y[(j * n + r) * per:(j * n + r + 1) * per])
             for j in range(K)]
    ddp = DDP(m, bucket_cap_mb=0) if use_ddp else None
    loss = forward_backward(ddp or m, micro, n, ddp)
    if ddp is None:
        allreduce_gradients_flat(m)
    return {name: p.grad.clone() for name, p in m.named_parameters()}, loss


@pytest.mark.parametrize("world, use_ddp", [(1, False), (2, True), (2, False), (4, True)])
def test_accumulation_with_masks_equals_one_big_batch(world, use_ddp):
    ref = _one_process_grads()
    for grads, _ in launch(_accumulated_grads, world, use_ddp):
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_per_micro_batch_mean_would_be_wrong():
    """The check above can fail: averaging per-micro-batch means (the common mistake)
    weighs the tokens of short micro-batches more, and gives a different gradient."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG))
    x, y = _batch()
    for j in range(K):
        sl = slice(j * B // K, (j + 1) * B // K)
        (m(x[sl], y[sl])[1] / K).backward()
    ref = _one_process_grads()
    assert not torch.allclose(m.wte.weight.grad, ref["wte.weight"], rtol=1e-3)
