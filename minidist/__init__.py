"""minidist: distributed training rebuilt on torch.distributed, to learn from.

BOOK is the book: the plain form of each chapter's idea, a few lines each, in reading
order, at most 2,500 lines together (tests/test_frames.py). Each is held equal to the
optimised form that training uses beside it by a test (tests/test_simple_forms.py and
each chapter's tests); read these first, the rest of each folder after.
"""

BOOK = (
    "minidist.comm",                     # 02 ring all-reduce, reduce-scatter, all-gather from send/recv
    "minidist.ddp",                      # 03 data parallelism: naive, flat, bucketed
    "minidist.train",                    # 04 gradient accumulation, the token-weighted loss
    "minidist.scaler",                   # 05 the plain dynamic loss scaler first
    "minidist.zero.simple",              # 06 the three ZeRO steps
    "minidist.muon.plain",               # 07 Newton-Schulz, Muon, distributed Muon round by round
    "minidist.checkpoint.plain",         # 08 a sharded save and load
    "minidist.memory.recompute",         # 09 recomputation (activation checkpointing)
    "minidist.tensor_parallel.layers",   # 10 the f/g pair, column/row layers, the parallel MLP/attention
    "minidist.pipeline.schedules",       # 11 stages, GPipe and 1F1B
    "minidist.context_parallel.ring",    # 12 ring attention, online softmax
    "minidist.experts.moe",              # 13 a router, top-k, capacity, balance, dispatch and combine
)
