"""Chapter 13, experts (chapters/13_experts.md): a mixture of experts and expert
parallelism. Read in this order:

    moe.py       the router, top-k, capacity, the balance loss, dispatch and combine, one process
    parallel.py  the experts spread over an ep group, tokens to them and back by all-to-all
    gpt.py       the GPT with MoE MLPs, its parameters and FLOPs (active vs total)

The gradient rules (an expert's gradient summed over its replicas only) are in
minidist/compose/expert_sync.py, where experts meet data parallelism.
"""

from minidist.experts.moe import route, capacity, keep_first, balance_sum, Expert, MoE
from minidist.experts.parallel import ExpertParallelMoE, expert_parallel, local_experts, mark_experts
from minidist.experts.gpt import (MoEConfig, MoEGPT, expert_stats, moe_blocks, moe_flops_per_token,
                                  moe_num_params)
