"""The training library: what one optimizer step is made of, shared by train_gpt.py,
the notebooks, the tests and the benchmarks. It takes no technique of its own: what picks
the optimizers and the gradient sync from them is minidist/compose/build.py.

Chapter 04 (chapters/04_grad_accum.md) explains forward_backward (accumulation and the
token-weighted loss); chapter 01 the schedule and evaluation. Between the steps: whether
the state is finite (a checkpoint's condition). Exercised by
`torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py` and
`pytest tests/test_grad_accum.py`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from minidist.scaler import LossScaler, autocast


def target_count(micro_batches, groups=(None,), device=None) -> torch.Tensor:
    """The target tokens of the global batch, what a step's summed loss is divided by: these
    micro-batches' (-1 masked), summed over each of `groups` (None: the world; none at all:
    this rank's own), in float64, exact. Refused if every target is masked."""
    if not micro_batches:
        raise ValueError("no micro-batches to step on: give at least one (x, y)")
    count = sum((y != -1).sum() for _, y in micro_batches).to(device, torch.float64).reshape(1)
    for group in groups:
        dist.all_reduce(count, group=group)
    if count.item() == 0:
        raise ValueError("every target in this global batch is masked (-1): nothing to learn from")
    return count


def micro_batch_shape(micro_batches) -> tuple:
    """The (b, T) that every micro-batch's x and y share, as a pipeline's receive buffers need
    (sized from it before anything arrives); a ValueError naming the shapes otherwise."""
    shapes = sorted({tuple(t.shape) for mb in micro_batches for t in mb})
    if len(shapes) != 1 or len(shapes[0]) != 2:
        raise ValueError(f"pipeline micro-batches must all be (x, y) of one shape (b, T), got {shapes or 'none'}: "
                         "pad the short ones or drop them")
    return shapes[0]


def forward_backward(model, micro_batches, world_size: int, sync=None,
                     scaler: LossScaler | None = None, precision: str = "fp32", group=None) -> float:
    """Gradients of one optimizer step over this rank's micro-batches; returns the loss.

    The loss is normalised by the number of target tokens in the whole global batch (all
    micro-steps, all ranks; targets of -1 are masked and do not count), so every token
    weighs the same however the tokens fall across micro-batches and ranks. Gradient
    averaging divides by world_size, so each rank scales its summed loss by world_size /
    global_tokens. `sync` is what averages the gradients (None: nothing does): all
    micro-steps but the last run in its no_sync(), and when this returns its
    finish_gradient_synchronization() has run. The forward runs under autocast at
    `precision`; with a scaler, the loss is multiplied by its scale before backward.
    `group` (chapter 10's mesh): the data-parallel group, of `world_size` ranks.
    """
    count = target_count(micro_batches, (group,))  # one tiny collective per step
    total = torch.zeros((), dtype=torch.float64, device=count.device)
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if sync is None or last else sync.no_sync()):
            with autocast(x.device, precision):
                _, loss_sum = model(x, y, reduction="sum")  # fp32: autocast reduces in fp32
            loss = loss_sum.float() * (world_size / count.item())
            (scaler.scale(loss) if scaler else loss).backward()
        total += loss_sum.detach().double()
    if sync is not None:  # naive and flat all-reduce now; DDP and ZeRO have (no-op)
        sync.finish_gradient_synchronization()
    dist.all_reduce(total, group=group)  # for the log: the global batch's mean loss per token
    return (total / count).item()


def lr_at(step: int, lr: float, warmup_steps: int, steps: int, min_lr_ratio: float = 0.1) -> float:
    """The learning rate of `step` (from 0) of `steps`: linear warmup to `lr` over
    `warmup_steps`, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(1, steps - 1 - warmup_steps)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def finite_state(model, optimizers, scaler: LossScaler | None = None) -> bool:
    """Whether everything a checkpoint would hold is finite on every rank: the parameters
    and buffers, every optimizer's state (under ZeRO, this rank's shards, which are the
    state's keys) and the loss scale. One small all-reduce, so every rank gets the same
    answer and saves, or skips the save, together. A NaN in any of them and the
    checkpoint would be the newest one, replacing a good one."""
    def tensors():
        yield from model.parameters()
        yield from model.buffers()
        for opt in optimizers:
            for holder, state in opt.state.items():
                yield holder
                yield from state.values()
    def present(t):  # ZeRO-3's parameters at rest have no storage: their values are the shards
        return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()
    ok = all(torch.isfinite(t).all() for t in tensors()
             if torch.is_tensor(t) and t.is_floating_point() and t.numel() and present(t))
    if scaler is not None and scaler.enabled and not math.isfinite(scaler.get_scale()):
        ok = False
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    return bool(ok)


@torch.no_grad()
def evaluate(model, loader, info, tok_bytes, max_windows=None, precision="fp32",
             group=None, loss_fn=None) -> tuple[float, float]:
    """(mean loss in nats per token, bits per byte) over the validation windows, all
    ranks sharing the work, the forward pass in the training precision. Bits per byte
    divides by the UTF-8 bytes of the predicted tokens, so it compares across tokenizers.
    `loss_fn(x, y)`: the summed loss (default: the model's; a step's loss_sum, compose/build.py)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # nats, tokens, bytes
    windows = list(loader.all_windows(max_windows))
    for i in range(0, len(windows), 16):
        w = torch.stack([torch.from_numpy(loader.window(j)) for j in windows[i:i + 16]])
        x, y = w[:, :-1].to(info.device), w[:, 1:].to(info.device)
        with autocast(info.device, precision):
            loss = model(x, y, reduction="sum")[1] if loss_fn is None else loss_fn(x, y)
        sums += torch.tensor([loss.item(), y.numel(), tok_bytes[w[:, 1:].numpy()].sum()],
                             dtype=torch.float64)
    sums = sums.to(info.device)
    dist.all_reduce(sums, group=group)  # (the data-parallel group: tp ranks share windows)
    model.train()
    nats, n, nbytes = sums.tolist()
    return nats / n, nats / math.log(2) / max(nbytes, 1)
