"""The answer key of exercise 10: minidist's implementations (minidist/tensor_parallel/),
given the exercise's signatures. `python -m exercises.grade 10 --reference` grades these."""

from __future__ import annotations

import torch.nn.functional as F

from minidist.tensor_parallel import gpt, layers


def vocab_parallel_cross_entropy(logits, targets, start, group):
    """minidist's loss over a split vocabulary, the mean over the tokens."""
    return gpt.vocab_parallel_cross_entropy(logits, targets, start, group)


def qkv_shard(weight, bias, n_head, rank, world_size):
    """The rows of c_attn that minidist's ParallelAttention gives rank `rank`."""
    C = weight.shape[1]
    a, b = layers.shard_range(C, rank, world_size)
    spec = (0, tuple((a + i * C, b + i * C) for i in range(3)))
    return layers.shard_of(weight, spec), None if bias is None else layers.shard_of(bias, spec)


def sequence_parallel_mlp(x, w_fc, w_proj, group, p=0.0):
    """The block from minidist's sequence-parallel pieces."""
    h = layers.gather_sequence(x, group)
    y = layers.reduce_scatter_sequence(F.linear(F.gelu(F.linear(h, w_fc), approximate="tanh"), w_proj), group)
    if p > 0:
        with layers.tp_rng(group, x.device):
            y = F.dropout(y, p, training=True)
    return x + y
