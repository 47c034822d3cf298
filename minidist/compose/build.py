"""A training run built from its techniques: the one place that chooses among them, so
train_gpt's loop asks no technique questions. Chapter 04 (chapters/04_grad_accum.md) teaches
the step; each technique's chapter its part: shard_model (10, 11, 12), make_optimizers (06, 07,
10), gradient_sync (03, 06, 07, 10, 11), and make_step, one interface (forward_backward,
loss_sum, generate) for a whole model and a pipeline stage (11). Exercised by
`torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py` and `pytest tests/test_train_gpt.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.compose.expert_sync import ExpertSync, expert_groups, expert_adamw
from minidist.compose.mesh import MeshSync
from minidist.context_parallel import ContextParallelGPT, split_sequence
from minidist.compose.pipeline_sync import PipelineSync, pipeline_eval, pipeline_generate
from minidist.compose.tp_muon import TensorParallelMuon, tensor_parallel_group
from minidist.compose.zero_muon import muon_for_zero, muon_under_zero
from minidist.ddp import DDP, FlatDDP, NaiveDDP
from minidist.experts import MoEGPT, expert_parallel, mark_experts
from minidist.muon import Muon, split_params
from minidist.pipeline import Stage, run_schedule, stage_for
from minidist.scaler import LossScaler, autocast
from minidist.tensor_parallel.gpt import parallelize
from minidist.train import forward_backward
from minidist.zero import ShardedOptimizer, zero_optimizer


def shard_model(model, mesh=None, sequence_parallel: bool = False, cp_attention: str = "ring",
                cp_layout: str = "zigzag", ep: int = 1, schedule: str = "1f1b", virtual_stages: int = 2):
    """This rank's part of the full `model` on a dp x tp x pp `mesh` (None: all of it):
    its slices of every layer (chapter 10), then its stage's blocks as the pipeline `schedule`
    runs them (chapter 11: contiguous, or interleaved's `virtual_stages` chunks round the ring);
    on a cp axis, all of it run on its slice of the sequence (chapter 12); an MoE GPT's
    routing counted over the world, its experts spread over ep ranks (chapter 13)."""
    if isinstance(model, MoEGPT):  # (train_gpt: experts with data parallelism alone)
        for layer in model.moe_layers() if dist.get_world_size() > 1 else ():
            layer.group = dist.group.WORLD  # every rank holds other tokens
        model.expert_groups = expert_groups(ep)  # (ep 1: every rank a replica of every expert)
        if ep > 1:
            expert_parallel(model, model.expert_groups[0], dist.group.WORLD)
        else:
            mark_experts(model)
    if mesh is not None and mesh.cp > 1:  # (train_gpt refuses cp with tp or pp)
        return ContextParallelGPT(model, mesh.cp_group, cp_attention, cp_layout)
    if mesh is not None and mesh.tp > 1:
        model = parallelize(model, mesh.tp_group, sequence_parallel)
    if mesh is not None and mesh.pp > 1:
        model = stage_for(schedule, model, mesh.pp_group, virtual_stages)
    return model


def make_optimizers(model, *, lr: float, optimizer: str = "adamw", weight_decay: float = 0.1,
                    zero_stage: int = 0, bucket_cap_mb: float = 25.0, muon_lr: float = 0.02,
                    muon_momentum: float = 0.95, muon_weight_decay: float = 0.0,
                    muon_ns_coefficients: str = "jordan", group=None,
                    param_dtype: torch.dtype | None = None) -> list[torch.optim.Optimizer]:
    """AdamW (weight decay on matrices only), sharded by ZeRO when asked; or, with
    optimizer="muon", Muon for the hidden matrices plus AdamW for the rest (under ZeRO: Muon
    beside it, compose/zero_muon.py; on tensor-parallel shards: compose/tp_muon.py, gathered).
    Each group remembers its peak lr. `group`: the ranks ZeRO shards over and Muon deals its
    matrices over (on a mesh the data-parallel group; all ranks by default). `param_dtype`:
    ZeRO-3's mixed-precision policy with AdamW (FullyShardedOptimizer's; chapter 06, appendix F)."""
    if param_dtype is not None and (zero_stage != 3 or optimizer == "muon" or isinstance(model, Stage)):
        raise ValueError("param_dtype is ZeRO-3's policy, for AdamW on a whole model: use zero_stage=3 with "
                         "optimizer='adamw', or param_dtype=None (and autocast)")
    hidden, rest = split_params(model) if optimizer == "muon" else ([], list(model.parameters()))
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    experts = getattr(model, "expert_groups", None)  # (ep group, replicas) of an MoE GPT
    if zero_stage and isinstance(model, Stage):  # chapter 11: ZeRO-1 of a pipeline stage
        # takes its shard of gradients averaged after the pipeline step (PipelineSync)
        opts = [ShardedOptimizer(groups, torch.optim.AdamW, group=group, stage=1, reduce_gradients=False,
                                 bucket_cap_mb=bucket_cap_mb, module=model, **adamw)]
    elif experts:  # chapter 13: ExpertSync averages, ZeRO-1 shards each part's state
        opts = expert_adamw(groups, experts[1], group, zero_stage, bucket_cap_mb, **adamw)
    elif zero_stage:  # ZeRO averages the gradients itself, with reduce-scatters
        opts = [zero_optimizer(model, groups, torch.optim.AdamW, zero_stage,  # (stage 3 shards
                               bucket_cap_mb=bucket_cap_mb, others=hidden, group=group, param_dtype=param_dtype,
                               **adamw)]
    else:
        opts = [torch.optim.AdamW(groups, **adamw)]
    if hidden:
        muon = dict(lr=muon_lr, momentum=muon_momentum, weight_decay=muon_weight_decay,
                    ns_coefficients=muon_ns_coefficients)
        tp_group = tensor_parallel_group(model)  # chapter 10: Muon's matrices are shards
        if tp_group is not None:  # (stages 1-2: whole shards on every dp rank, as Muon wants)
            opts.append(TensorParallelMuon(hidden, tp_group, "gather", group=group, **muon))
        else:
            # experts: an ep group's ranks hold other experts, their replicas the same matrices,
            # so Muon deals its matrices over the replicas (each orthogonalised whole by one)
            opts.append(Muon(hidden, group=experts[1], **muon) if experts else
                        muon_for_zero(opts[0], hidden, group=group, **muon) if zero_stage else
                        Muon(hidden, group=group, **muon))
    for g in (g for o in opts for g in o.param_groups):
        g["peak_lr"] = g["lr"]
    return opts


def gradient_sync(model, opts, *, zero_stage: int = 0, dp: str = "bucketed", bucket_cap_mb: float = 25.0,
                  mesh=None):
    """What averages the gradients across ranks, behind minidist/sync.py's interface: under
    ZeRO the optimizer itself (with Muon beside it, MuonUnderZero), otherwise DDP as `dp`
    (naive, flat or bucketed) asks; on a mesh over the dp group, MeshSync adding the norm
    over the tp shards (chapter 10); a pipeline stage's averages after the step (chapter 11);
    with a cp axis, over the dp x cp ranks, whose tokens differ (chapter 12)."""
    group = None if mesh is None else mesh.dp_cp_group
    if getattr(model, "expert_groups", None):  # chapter 13: an expert summed over its replicas only
        return ExpertSync(model, *model.expert_groups, zeros=[o for o in opts if isinstance(o, ShardedOptimizer)])
    if mesh is not None and mesh.pp > 1:
        return PipelineSync(model, group, flat=dp != "naive", zero=opts[0] if zero_stage else None)
    if zero_stage:
        muons = [o for o in opts if isinstance(o, Muon)]
        sync = muon_under_zero(opts[0], muons[0]) if muons else opts[0]
    elif dp == "naive":
        sync = NaiveDDP(model, group=group)
    elif dp == "flat":
        sync = FlatDDP(model, group=group)
    else:
        sync = DDP(model, bucket_cap_mb=bucket_cap_mb, group=group)
    return sync if mesh is None or mesh.tp == 1 else MeshSync(sync, mesh.tp_group)


class PlainStep:
    """One optimizer step's gradients, the evaluation loss and sampling of a whole (or
    tensor-parallel) model: chapter 04's forward_backward over `world_size` replicas
    (`group`: the data-parallel group on a mesh)."""

    def __init__(self, model, sync, scaler: LossScaler | None, precision: str, world_size: int, group=None):
        self.model, self.sync, self.scaler, self.precision = model, sync, scaler, precision
        self.world_size, self.group = world_size, group

    def forward_backward(self, micro_batches) -> float:
        """The gradients of one step, averaged; returns the global batch's mean loss per token."""
        return forward_backward(self.model, micro_batches, self.world_size, self.sync, self.scaler,
                                self.precision, self.group)

    def loss_sum(self, x, y) -> torch.Tensor:
        """The loss summed over the targets: what minidist.train.evaluate adds up."""
        return self.model(x, y, reduction="sum")[1]

    def generate(self, idx, max_new_tokens: int, **kw) -> torch.Tensor:
        return self.model.generate(idx, max_new_tokens, **kw)

    def describe(self, micro_steps: int) -> str:
        return ""  # nothing to add to the run's first line


class PipelineStep(PlainStep):
    """The same three calls for a pipeline stage (chapter 11): the micro-batches through
    `schedule` (one of minidist.pipeline.ALL_SCHEDULES, by run_schedule), the loss normalised
    as forward_backward does (times the loss scale), then the gradients averaged over the
    data-parallel replicas; evaluation and sampling forward only through the stages
    (minidist/compose/pipeline_sync.py). Every stage gets the same loss, the same summed loss
    and the same tokens."""

    def __init__(self, stage, sync, scaler, precision, world_size, group, schedule: str, mesh):
        super().__init__(stage, sync, scaler, precision, world_size, group)
        self.schedule, self.mesh = schedule, mesh

    def forward_backward(self, micro_batches) -> float:
        scaler, device = self.scaler, next(self.model.parameters()).device
        loss = run_schedule(self.model, micro_batches, self.schedule, self.group,
                             loss_scale=scaler.get_scale() if scaler is not None and scaler.enabled else 1.0,
                             amp=lambda: autocast(device, self.precision))
        self.sync.finish_gradient_synchronization()
        return loss

    def loss_sum(self, x, y) -> torch.Tensor:
        return pipeline_eval(self.model, x, y)

    def generate(self, idx, max_new_tokens: int, **kw) -> torch.Tensor:
        return pipeline_generate(self.model, idx, max_new_tokens, **kw)

    def describe(self, micro_steps: int) -> str:
        how = "one flat all-reduce" if self.sync.flat else "per parameter"
        return (f"pipeline | {self.mesh.describe()} | {self.schedule}, {micro_steps} micro-batches | "
                f"{self.model.describe()} | gradients averaged over dp after each step ({how})")


class ContextStep(PlainStep):
    """The same three calls on a cp axis (chapter 12): every micro-batch cut into this rank's
    slice of each sequence, then chapter 04's forward_backward over the dp x cp ranks, whose
    tokens are all different: each rank's loss is its own tokens' sum, normalised by the
    global token count, and one all-reduce over dp x cp averages the gradients."""

    def __init__(self, model, sync, scaler, precision, mesh):
        super().__init__(model, sync, scaler, precision, mesh.dp * mesh.cp, mesh.dp_cp_group)
        self.mesh = mesh

    def _slices(self, x, y):
        return tuple(split_sequence(t, self.mesh.cp_group, 1, self.model.layout) for t in (x, y))

    def forward_backward(self, micro_batches) -> float:
        return super().forward_backward([self._slices(x, y) for x, y in micro_batches])

    def loss_sum(self, x, y) -> torch.Tensor:
        """The whole sequences' summed loss, on every cp rank (evaluation adds over dp)."""
        loss = self.model(*self._slices(x, y), reduction="sum")[1].detach().float().reshape(1)
        dist.all_reduce(loss, group=self.mesh.cp_group)
        return loss[0]

    def describe(self, micro_steps: int) -> str:
        return (f"context parallel | {self.mesh.describe()} | {self.model.describe()} | gradients "
                "averaged over the dp x cp ranks in one all-reduce")


def make_step(model, sync, scaler: LossScaler | None, precision: str, world_size: int, group=None,
              schedule: str = "1f1b", mesh=None) -> PlainStep:
    """The step interface for this rank's model: a PipelineStep for a pipeline stage (with
    its `schedule`, on `mesh`), a ContextStep on a cp axis, a PlainStep otherwise."""
    if mesh is not None and mesh.cp > 1:
        return ContextStep(model, sync, scaler, precision, mesh)
    if isinstance(model, Stage):
        return PipelineStep(model, sync, scaler, precision, world_size, group, schedule, mesh)
    return PlainStep(model, sync, scaler, precision, world_size, group)
