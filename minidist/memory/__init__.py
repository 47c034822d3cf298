"""Chapter 09, memory (chapters/09_memory.md): where a step's memory goes, and how to fit a budget.
Read in this order:

    recompute.py  activation checkpointing on torch.autograd.Function (the plain form)
    estimate.py   activations counted and derived, the memory model of a step, a measured peak
    plan.py       the planner: ZeRO stage, micro-steps and recomputation for a budget
"""

# chapter 09's formulas live beside the rest of the cost model's
from minidist.cost_model import (GB, activation_bytes, block_activation_bytes, head_activation_bytes, model_state_bytes,
                                 zero3_gathered_bytes)
from minidist.memory.estimate import count_saved_bytes, gib, measure_peak, step_memory, storages_now
