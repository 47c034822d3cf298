"""ZeRO, stages 1, 2 and 3, as one package. Chapter 06 (chapters/06_zero.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --zero-stage 2
    pytest tests/test_zero.py

Read in this order:
    simple.py   the plain steps, a few lines each on torch.distributed (notebook 06 builds
                them): zero1_step, zero2_step, and zero3_step over shard_per_block's units;
                the classes below are held equal to them (tests/test_simple_forms.py)
    layout.py   the flat padded shard layout (a Unit: parameters in one buffer, cut N ways)
    base.py     ZeroBase, what every stage shares once it has its units: the inner
                optimizer on this rank's shards, the reduce-scatters of the gradients, the
                gradient-sync interface (minidist/sync.py), clipping, checkpoint pieces
    stage12.py  ShardedOptimizer: ZeRO-1 (optimizer state) and ZeRO-2 (also gradients);
                its units are buckets, as DDP's
    stage3.py   FullyShardedOptimizer: ZeRO-3 (also parameters, gathered per block);
                its units are the transformer blocks and the root
    fsdp.py     the same ZeRO-3 in FSDP2's shape: fully_shard(module, mp_policy=...) per
                module, bottom-up, any torch optimizer on the shards; MixedPrecisionPolicy
    fsdp_sync.py  ShardedModules: base.py's ShardSync driven by fully_shard's hooks
    fsdp_model.py FSDP(model, wrap=predicate): fully_shard on what `wrap` accepts, the
                rest replicated and averaged
And zero_optimizer below, the one entry point for all three stages. (Muon beside the
shards joins two ideas: minidist/compose/zero_muon.py.)
"""

from __future__ import annotations

import torch.nn as nn

from minidist.zero.fsdp import MixedPrecisionPolicy, fully_shard
from minidist.zero.fsdp_model import FSDP
from minidist.zero.layout import Unit
from minidist.zero.stage12 import ShardedOptimizer
from minidist.zero.stage3 import FullyShardedOptimizer

__all__ = ["ShardedOptimizer", "FullyShardedOptimizer", "zero_optimizer", "Unit",
           "MixedPrecisionPolicy", "fully_shard", "FSDP"]


def zero_optimizer(model: nn.Module, param_groups, optimizer_class, stage: int, **kwargs):
    """A ShardedOptimizer that averages the gradients itself (stages 1, 2) or a
    FullyShardedOptimizer over `model` (stage 3). `others`: parameters another optimizer
    (Muon) updates; stage 3 shards them too, stages 1-2 leave them whole. `param_dtype`,
    `reduce_dtype` (stage 3): the mixed-precision policy of its gathers and reduce-scatters."""
    if stage in (1, 2):
        kwargs.pop("prefetch", None)
        kwargs.pop("others", None)
        if kwargs.pop("param_dtype", None) is not None or kwargs.pop("reduce_dtype", None) is not None:
            raise ValueError(f"param_dtype and reduce_dtype are ZeRO-3's (it gathers the parameters): "
                             f"use stage 3, or autocast at stage {stage}")
        return ShardedOptimizer(param_groups, optimizer_class, stage=stage, reduce_gradients=True,
                                module=model, **kwargs)
    if stage == 3:
        return FullyShardedOptimizer(model, param_groups, optimizer_class, **kwargs)
    raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
