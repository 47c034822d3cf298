"""Chapter 10, tensor parallelism (chapters/10_tensor_parallel.md): each layer's matrices split
over a group. Read in this order:

    layers.py  the f/g pair, column- and row-parallel layers, sequence parallelism
    gpt.py     the GPT split: attention by heads, MLP by width, vocabulary; parallelize()
    cost.py    bytes, parameters, activations and step time in closed form

The dp x tp mesh and Muon on shards combine ideas: minidist/compose/.
"""

from minidist.tensor_parallel.layers import (copy_to_region, reduce_from_region, gather_sequence,
    reduce_scatter_sequence, shard_of, ColumnParallelLinear, RowParallelLinear, used_on_positions, tp_rng,
    dropout)
from minidist.tensor_parallel.gpt import parallelize
