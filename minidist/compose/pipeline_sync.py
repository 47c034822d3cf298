"""Pipeline parallelism composed with the rest of a training run: a stage's gradient sync
over its data-parallel replicas (plain averaging, or feeding ZeRO-1's shards), the norm for
clipping summed over the stages, and the forward-only passes of evaluation and sampling.
Chapter 11 (chapters/11_pipeline.md), section "composed"; an InterleavedStage (its appendix,
section G) is run chunk by chunk round the ring. Exercised by
`torchrun --standalone --nproc_per_node=4 minidist/train_gpt.py --pp 2 --grad-accum-steps 4`
and `pytest tests/test_train_gpt.py -k pp`.

The averaging waits for the whole pipeline step: a stage's gradient is complete only after
its last backward and the tied embedding's sum, and a pipeline interleaves forwards and
backwards, so DDP's buckets would average partial gradients. ZeRO-2 and 3 are refused: they
would re-shard the gradients or re-gather the parameters every micro-batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.ddp import ReplicaSync, allreduce_gradients_flat, allreduce_gradients_naive, unique_params
from minidist.pipeline import Stage, exchange
from minidist.tensor_parallel.gpt import plain_layout


class PipelineSync(ReplicaSync):
    """The gradient-sync interface (minidist/sync.py) of one pipeline stage, replicated on
    the ranks of `dp_group`; `flat`: one all-reduce of a flat buffer (else one per parameter);
    `zero`: a ZeRO-1 ShardedOptimizer (reduce_gradients=False) filled from the averages. The
    norm is the whole model's: summed over the stages, the tied embedding counted half on
    each end; on a tensor-parallel stage over the tp group too, as MeshSync does."""

    def __init__(self, stage: Stage, dp_group=None, flat: bool = True, zero=None):
        self.stage = self.module = stage  # the module ReplicaSync's norm and scaling read
        self.group, self.flat, self.zero = dp_group, flat, zero
        self.tp_group = stage.tp_group
        self.t = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        self._in_zero = set() if zero is None else {id(p) for u in zero.units for p in u.params}
        self.tied = stage.wte.weight if stage.tied_peer is not None else None

    def finish_gradient_synchronization(self) -> None:
        """Average over the replicas; call once per step, after pipeline_step (a second call
        would average again)."""
        (allreduce_gradients_flat if self.flat else allreduce_gradients_naive)(self.stage, self.group)
        if self.zero is not None:
            self.zero.finish_gradient_synchronization()  # this rank's shard, copied in

    def _weight(self, weight):
        def w(p):
            base = 1.0 if weight is None else weight(p)
            if getattr(p, "tp_shard", None) is None:
                base /= self.t  # the same on every tp rank: counted once over the group
            return base / 2 if p is self.tied else base
        return w

    def grad_square_sum(self, weight=None) -> torch.Tensor:
        w = self._weight(weight)
        if self.zero is None:
            sq = super().grad_square_sum(w)  # averaged: the same on every replica
        else:  # ZeRO's shards (summed over dp), plus what it does not hold (Muon's matrices)
            sq = self.zero.grad_square_sum(w) + sum(
                (w(p) * p.grad.double().square().sum() for p in unique_params(self.stage)
                 if id(p) not in self._in_zero and p.grad is not None), torch.zeros((), dtype=torch.float64))
        sq = torch.as_tensor(sq, dtype=torch.float64).reshape(1).clone()
        dist.all_reduce(sq, group=self.stage.group)  # every stage's part: one number everywhere
        if self.t > 1:
            dist.all_reduce(sq, group=self.tp_group)  # and every slice's
        return sq[0]

    def scale_grads(self, coef) -> None:
        super().scale_grads(coef)
        if self.zero is not None:
            self.zero.scale_grads(coef)


def _through(stage: Stage, x: torch.Tensor) -> torch.Tensor | None:
    """Forward only, chunk after chunk (a Stage is one; an InterleavedStage's go round the
    ring of ranks v times): receive the activation from the rank before in the ring (the
    first chunk of all reads the tokens `x`), run the chunk's blocks, send the result on.
    Returns the last chunk's last block's output on its rank (the last), None elsewhere."""
    p, s, n = next(stage.parameters()), stage.stage, stage.stages
    ranks = dist.get_process_group_ranks(stage.group or dist.group.WORLD)
    chunks = getattr(stage, "chunks", [stage.layers])
    for c, layers in enumerate(chunks):
        vstage = c * n + s
        if vstage == 0:
            h = stage.embed(x)
        else:  # chunk c of the rank before, or at rank 0 chunk c - 1 of the last rank
            h = torch.empty(stage.activation_shape(*x.shape), dtype=p.dtype, device=p.device)
            exchange(stage.group, recvs=[(h, ranks[(s - 1) % n])])
        for i in layers:
            h = stage.blocks[str(i)](h)
        if vstage == n * len(chunks) - 1:
            return h
        exchange(stage.group, sends=[(h.to(p.dtype).contiguous(), ranks[(s + 1) % n])])
    return None


@torch.no_grad()
def pipeline_eval(stage: Stage, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss summed over the targets of (x, y), computed through the pipeline without
    backward, on every stage of it (float64). Every stage is handed the same x, y."""
    h = _through(stage, x)
    total = torch.zeros(1, dtype=torch.float64, device=x.device)
    if h is not None:
        total += stage.head(h, y, "sum")[1].double()
    dist.all_reduce(total, group=stage.group)  # only the last stage added anything
    return total[0]


@torch.no_grad()
def pipeline_generate(stage: Stage, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                      top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """GPT.generate through the pipeline: each new token is one full forward, the last stage
    samples it (the same arithmetic and generator as GPT.generate) and broadcasts it to the
    other stages, so every stage returns the same tokens. Under sequence parallelism the
    stages run in the plain layout (a growing prompt would rarely split evenly)."""
    last = dist.get_process_group_ranks(stage.group or dist.group.WORLD)[-1]
    with plain_layout(stage):
        for _ in range(max_new_tokens):
            h = _through(stage, idx[:, -stage.config.block_size:])
            nxt = torch.zeros((idx.size(0), 1), dtype=idx.dtype, device=idx.device)
            if h is not None:  # the full vocabulary's logits (gathered over tp, if split)
                logits = stage.head(h)[0][:, -1, :].float() / max(temperature, 1e-6)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            dist.broadcast(nxt, src=last, group=stage.group)
            idx = torch.cat([idx, nxt], dim=1)
    return idx
