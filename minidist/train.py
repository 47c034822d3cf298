"""The training library: what one optimizer step is made of, shared by train_gpt.py,
the notebooks, the tests and the benchmarks.

Chapter 04 (chapters/04_grad_accum.md) explains forward_backward (accumulation and the
token-weighted loss); chapter 01 the schedule and evaluation, chapter 07 make_optimizers
(Muon beside AdamW), chapter 03 gradient_sync (whatever averages the gradients, behind one
interface). Between the steps: whether the state is finite (a checkpoint's condition),
a signal turned into a clean stop, and where a run resumes from (find_resume). Exercised by
`torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py` and
`pytest tests/test_grad_accum.py`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from minidist.ddp import DDP, FlatDDP, NaiveDDP
from minidist.compose.mesh import MeshSync
from minidist.muon import Muon, split_params
from minidist.pipeline import pipeline_step
from minidist.compose.pipeline_sync import PipelineSync
from minidist.scaler import LossScaler, autocast
from minidist.compose.tp_muon import TensorParallelMuon, tensor_parallel_group
from minidist.zero import ShardedOptimizer, zero_optimizer
from minidist.compose.zero_muon import muon_for_zero, muon_under_zero


def make_optimizers(model, args, group=None) -> list[torch.optim.Optimizer]:
    """AdamW (weight decay on matrices only), sharded by ZeRO when asked; or Muon for the
    hidden matrices plus AdamW for embeddings, head, gains and biases (under ZeRO stages
    1-2 AdamW's in the shards, Muon's matrices whole; at stage 3 Muon's matrices sharded
    too, by the ZeRO-3 optimizer, for Muon to update: gradient_sync joins them). Each group
    remembers its peak lr. `group`: the ranks ZeRO shards over and Muon deals its matrices
    over (chapter 10's mesh: the data-parallel group; all ranks by default). On a
    tensor-parallel model Muon orthogonalises the whole matrices its shards cut
    (minidist/compose/tp_muon.py, gathered: the same arithmetic as one process)."""
    hidden, rest = split_params(model) if args.optimizer == "muon" else ([], list(model.parameters()))
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if args.zero_stage and getattr(args, "pp", 1) > 1:  # chapter 11: ZeRO-1 of a pipeline stage
        # takes its shard of gradients averaged after the pipeline step (PipelineSync)
        opts = [ShardedOptimizer(groups, torch.optim.AdamW, group=group, stage=1, reduce_gradients=False,
                                 bucket_cap_mb=args.bucket_cap_mb, module=model, **adamw)]
    elif args.zero_stage:  # ZeRO averages the gradients itself, with reduce-scatters
        opts = [zero_optimizer(model, groups, torch.optim.AdamW, args.zero_stage,  # (stage 3 shards
                               bucket_cap_mb=args.bucket_cap_mb, others=hidden, group=group, **adamw)]
    else:
        opts = [torch.optim.AdamW(groups, **adamw)]
    if hidden:
        muon = dict(lr=args.muon_lr, momentum=args.muon_momentum, weight_decay=args.muon_weight_decay,
                    ns_coefficients=getattr(args, "muon_ns_coefficients", "jordan"))
        tp_group = tensor_parallel_group(model)  # chapter 10: Muon's matrices are shards
        if tp_group is not None:  # (stages 1-2: whole shards on every dp rank, as Muon wants)
            opts.append(TensorParallelMuon(hidden, tp_group, "gather", group=group, **muon))
        else:
            opts.append(muon_for_zero(opts[0], hidden, group=group, **muon) if args.zero_stage
                        else Muon(hidden, group=group, **muon))
    for g in (g for o in opts for g in o.param_groups):
        g["peak_lr"] = g["lr"]
    return opts


def gradient_sync(model, opts, args, mesh=None):
    """What averages the gradients across ranks, behind the gradient-sync interface of
    minidist/ddp.py (no_sync, finish_gradient_synchronization, clip_grad_norm_): under
    ZeRO the optimizer itself (it reduce-scatters them), with Muon beside it
    MuonUnderZero (AdamW's shards, and Muon's matrices reduce-scattered to their owners);
    otherwise DDP as --dp asks. On a dp x tp mesh (chapter 10) that averaging runs over
    the dp group, and MeshSync adds the norm over the tensor-parallel shards."""
    group = None if mesh is None else mesh.dp_group
    if mesh is not None and mesh.pp > 1:  # chapter 11: averaged once, after the pipeline step
        return PipelineSync(model, group, flat=args.dp != "naive", zero=opts[0] if args.zero_stage else None)
    if args.zero_stage:
        muons = [o for o in opts if isinstance(o, Muon)]
        sync = muon_under_zero(opts[0], muons[0]) if muons else opts[0]
    elif args.dp == "naive":
        sync = NaiveDDP(model, group=group)
    elif args.dp == "flat":
        sync = FlatDDP(model, group=group)
    else:
        sync = DDP(model, bucket_cap_mb=args.bucket_cap_mb, group=group)
    return sync if mesh is None or mesh.tp == 1 else MeshSync(sync, mesh.tp_group)


def forward_backward(model, micro_batches, world_size: int, sync=None,
                     scaler: LossScaler | None = None, precision: str = "fp32", group=None) -> float:
    """Gradients of one optimizer step over this rank's micro-batches; returns the loss.

    The loss is normalised by the number of target tokens in the whole global batch (all
    micro-steps, all ranks; targets of -1 are masked and do not count), so every token
    weighs the same however the tokens fall across micro-batches and ranks. Gradient
    averaging divides by world_size, so each rank scales its summed loss by world_size /
    global_tokens. `sync` is what averages the gradients (gradient_sync: DDP, naive or
    flat, or a ZeRO optimizer; None: nothing does): all micro-steps but the last run in its
    no_sync(), with no communication until the gradients are complete, and when this
    returns its finish_gradient_synchronization() has run, so the gradients are averaged.
    The forward pass runs under autocast at `precision`; with a scaler, the loss is
    multiplied by its scale before backward. `group` (chapter 10's mesh): the ranks whose
    batches make up the global batch, the data-parallel group, of `world_size` ranks; the
    tensor-parallel ranks of one replica share their batch and compute one loss together.
    """
    # tokens in the global batch: one tiny collective per step (float64: exact counts)
    count = sum((y != -1).sum() for _, y in micro_batches).double().reshape(1)
    dist.all_reduce(count, group=group)
    if count.item() == 0:
        raise ValueError("every target in this global batch is masked (-1): nothing to learn from")
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


def pipeline_forward_backward(stage, micro_batches, sync, scaler: LossScaler, precision: str,
                              dp_group, schedule: str) -> float:
    """forward_backward for a pipeline stage (chapter 11): the micro-batches through the
    schedule (the loss normalised as forward_backward does, times the loss scale), then
    the gradients averaged over the data-parallel replicas. Returns the global batch's
    mean loss per token, on every stage."""
    device = next(stage.parameters()).device
    loss = pipeline_step(stage, micro_batches, schedule, dp_group,
                         loss_scale=scaler.get_scale() if scaler is not None and scaler.enabled else 1.0,
                         amp=lambda: autocast(device, precision))
    sync.finish_gradient_synchronization()
    return loss


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - 1 - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


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
    `loss_fn(x, y)`: the summed loss (default: the model's; a pipeline's pipeline_eval)."""
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
