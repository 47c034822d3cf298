"""Chapter 12, context parallelism (chapters/12_context_parallel.md): the sequence split
across the ranks of a cp group, so that activation memory falls with N, and attention,
the one layer whose tokens meet, computed exactly over the whole sequence anyway. Each
rank holds the queries, keys and values of its own tokens; the ways differ in how keys and
values reach the queries. Read in this order:

    layout.py     who holds which tokens: contiguous and zigzag slices, their true positions
    ring.py       the plain form: K, V blocks around a ring, merged by online softmax;
                  backward sends dK, dV around the same ring
    work.py       work per rank (the causal imbalance and zigzag's cure), bytes and memory,
                  counted on the run and in closed form
    allgather.py  the whole K, V gathered on every rank, then local attention (Llama 3)
    ulysses.py    all-to-all from sequence shards to head shards and back (DeepSpeed-Ulysses)
    gpt.py        the GPT over a cp group: every layer on this rank's tokens, attention by one
                  of the three ways, true positions, the GPT's parameter names

All three take q, k, v of shape (B, H, T_local, D) as split_sequence cut them and return
this rank's slice of the output, equal to F.scaled_dot_product_attention on the whole
sequence, gradients included (tests/test_context_parallel.py).
"""

from minidist.context_parallel.layout import LAYOUTS, split_sequence, gather_sequence, positions, chunk_ids
from minidist.context_parallel.ring import ring_attention, merge
from minidist.context_parallel.work import (count_work, ring_work, imbalance, slice_bytes, attention_bytes,
                                            attention_memory)
from minidist.context_parallel.allgather import allgather_attention
from minidist.context_parallel.ulysses import ulysses_attention
from minidist.context_parallel.gpt import ATTENTIONS, ContextParallelGPT, check_context_parallel
