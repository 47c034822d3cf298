"""What many tests build again and again: the tiny GPT, a global batch that every rank and
the oracle can rebuild from its step, a rank's share of it, and the one-process oracle
(the whole batch, a plain optimizer). Functions here also run inside launched ranks:
cloudpickle ships them by name, and the ranks import this file as tests start them
(tests/ is on their path through pytest's rootdir).

The tests keep their own models where the model is the point (a tied and frozen module in
test_ddp.py, a width that pads at 3 ranks in test_zero.py); this is for the rest.
"""

import torch

from minidist.model import GPT, GPTConfig

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """The tiny GPT (TINY, with `overrides`), its weights a function of `seed` alone."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def token_batch(step: int, batch: int, seq_len: int, vocab_size: int, masked: bool = False):
    """(x, y) of the global batch of step `step`: random tokens, y the next token. With
    `masked`, sequence i keeps seq_len - i - 1 targets (the rest are -1, ignored by the
    loss), so micro-batches hold different numbers of tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    if not masked:
        x = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
        return x, torch.roll(x, -1, dims=1)
    x = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    y = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    for i in range(batch):
        y[i, max(0, seq_len - i - 1):] = -1
    return x, y


def micro_batches(x, y, rank: int, world: int, k: int = 1) -> list:
    """Rank `rank`'s k micro-batches of the global batch (x, y), as minidist.data's
    TokenLoader deals them: micro-step j of rank r takes the (j * world + r)-th slice."""
    per = len(x) // (world * k)
    return [(x[(j * world + rank) * per:(j * world + rank + 1) * per],
             y[(j * world + rank) * per:(j * world + rank + 1) * per]) for j in range(k)]


def grads_of(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def one_process(model, batches, make_optimizer=None) -> dict:
    """The oracle: `model` trained in this process on each whole (x, y) of `batches` (the
    mean loss over all their targets), with `make_optimizer(params)` (none: one backward,
    for gradients). Returns {name: parameter} after training, or the gradients when there
    is no optimizer."""
    opt = make_optimizer(model.parameters()) if make_optimizer else None
    for x, y in batches:
        model(x, y)[1].backward()
        if opt is None:
            return grads_of(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def accumulated(model, micro_batches) -> tuple[float, dict]:
    """One process's gradient accumulation over `micro_batches`, the loss normalised by the
    target count of all of them (minidist.train.forward_backward's): (mean loss, {name: grad})."""
    count = sum(int((y != -1).sum()) for _, y in micro_batches)
    total = 0.0
    for x, y in micro_batches:
        _, loss_sum = model(x, y, reduction="sum")
        (loss_sum.float() * (1 / count)).backward()
        total += loss_sum.item()
    return total / count, {n: p.grad for n, p in model.named_parameters()}
