"""Every closed-form formula of minidist, once: the ring's bytes and messages (chapter 02),
the ZeRO paper's memory (06), Newton-Schulz FLOPs (07), step time from 8 to 1024 GPUs
(Chapter 08, chapters/08_at_scale.md) and the bytes a step keeps (derived in chapter 09,
which counts and measures them in minidist/memory/estimate.py). Exercised by
`python -m minidist.bench scale` and tests/test_cost_model.py.

A step on N GPUs is predicted from compute (flops_per_token at an assumed MFU), network
(alpha-beta, one pair inside a node and one between nodes) and memory. Scaling is weak, so
the efficiency is t(1) / t(N): an upper bound (perfect overlap, no stragglers), pessimistic
only in its flat ring and 2(N-1) latencies per all-reduce (`Hardware(latency="tree")`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from minidist.model import PRESETS, GPTConfig, config_num_params, flops_per_token

GB = 1e9  # decimal, as the datasheets count


@dataclass
class Hardware:
    """A cluster of identical GPUs in nodes. Defaults: H100 SXM in 8-GPU nodes (the DGX
    H100 shape), one 400 Gb/s InfiniBand NDR adapter per GPU."""
    name: str = "H100 SXM, 8 per node, NVLink 4, 400 Gb/s IB NDR per GPU"
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16 (1979 is with 2:4 sparsity);
    # the H200 has the same compute and more memory (141 GB HBM3e against 80 GB HBM3)
    peak_flops: float = 989e12
    mfu: float = 0.40             # assumed, and held at every N (see the docstring)
    gpus_per_node: int = 8
    # NVLink 4: 900 GB/s per GPU counting both directions, so 450 GB/s each way
    intra_GBps: float = 450.0
    intra_alpha_s: float = 3e-6   # an assumed order of magnitude: no datasheet quotes one
    # 400 Gb/s NDR = 50 GB/s each way, one adapter per GPU
    inter_GBps: float = 50.0
    inter_alpha_s: float = 10e-6  # assumed, as intra_alpha_s
    overlap: float = 1.0          # share of the compute that communication can hide behind
    latency: str = "ring"         # "ring": messages as minidist.comm's rings; "tree": log2 N


MEMORY_LIMITS_GB = (80.0, 141.0)  # H100 SXM (HBM3), H200 (HBM3e)

# The models at scale, by the labels the tables print: four of minidist.model.PRESETS (the
# one table of sizes), all with GPT-2's vocabulary (GPTConfig's default) and 1024-token
# context, so that one per-GPU micro-batch means the same for all.
SCALE_PRESETS = {"124M": "gpt2", "350M": "gpt2-medium", "1.3B": "gpt3-1.3b", "7B": "gpt3-6.7b"}
MODELS = {label: GPTConfig(**PRESETS[name]) for label, name in SCALE_PRESETS.items()}
STRATEGIES = ("dp", "zero1", "zero2", "zero3")

# Chapter 02's table, written out: the share of the buffer S each rank sends, and the
# messages each rank sends one after another (tests/test_comm.py counts the bytes on the
# wire; minidist.bench.collectives fits alpha and beta with these).
SENT_FRACTION = {"all_reduce": lambda n: 2 * (n - 1) / n,
                 "reduce_scatter": lambda n: (n - 1) / n,
                 "all_gather": lambda n: (n - 1) / n,
                 "all_to_all": lambda n: (n - 1) / n}  # pairwise: every block but one's own
MESSAGES = {
    "ring": {"all_reduce": lambda n: 2 * (n - 1),
             "reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1,
             "all_to_all": lambda n: n - 1},
    # log2 N rounds each way and the ring's bytes: chapter 02's recursive halving and
    # doubling (Rabenseifner) row. NCCL's trees have the latency; their bytes per link
    # come near the ring's, not to it, so "tree" is the optimistic end.
    "tree": {"all_reduce": lambda n: 2 * math.ceil(math.log2(n)),
             "reduce_scatter": lambda n: math.ceil(math.log2(n)),
             "all_gather": lambda n: math.ceil(math.log2(n)),
             "all_to_all": lambda n: n - 1},  # no tree: each block has its own destination
}


def link(n: int, hw: Hardware) -> tuple[float, float]:
    """(alpha, beta) of a collective over n GPUs. Every step of a ring waits for all its
    transfers, so once the ring leaves the node it runs at the slowest link's pace."""
    if n <= hw.gpus_per_node:
        return hw.intra_alpha_s, 1 / (hw.intra_GBps * GB)
    return max(hw.intra_alpha_s, hw.inter_alpha_s), 1 / (min(hw.intra_GBps, hw.inter_GBps) * GB)


def collective_time(op: str, nbytes: float, n: int, hw: Hardware, span: int | None = None) -> float:
    """Seconds for one collective on a buffer of nbytes (the whole S) over n GPUs; `span`:
    the consecutive ranks the group's members are spread over (a mesh's dp group, tp apart,
    spans dp x tp: chapter 11), which decides its slowest link (default n)."""
    if n == 1:
        return 0.0
    alpha, beta = link(span or n, hw)
    return MESSAGES[hw.latency][op](n) * alpha + SENT_FRACTION[op](n) * nbytes * beta


def comm_volume(strategy: str, psi: float, n: int, elem_bytes: int = 2, accum: int = 1) -> float:
    """Bytes each GPU sends per optimizer step of `accum` micro-steps, in units of
    Psi (N-1)/N elements: 2 for data parallelism and ZeRO-1, accum + 1 for ZeRO-2 (its
    gradients reduce-scattered every micro-step), 3 accum for ZeRO-3."""
    factor = {"dp": 2, "zero1": 2, "zero2": accum + 1, "zero3": 3 * accum}[strategy]
    return factor * psi * (n - 1) / n * elem_bytes


def muon_comm_volume(stage: int, psi_adamw: float, psi_muon: float, n: int, psi_root: float = 0.0,
                     elem_bytes: int = 4, update_bytes: int = 2) -> float:
    """Bytes each rank sends per step with Muon for the hidden matrices (psi_muon) and
    AdamW for the rest at ZeRO `stage` (chapter 07 derives each term). Flags and padding
    come on top."""
    psi, f = psi_adamw + psi_muon, (n - 1) / n
    grads = {0: 2 * psi, 1: 2 * psi_adamw + psi_muon, 2: 2 * psi_adamw + psi_muon,
             3: 3 * psi - psi_root}[stage] * f * elem_bytes
    updates = psi_muon * f * (1 / n if stage == 3 else 1) * update_bytes
    return grads + updates


def exposed_time(c: float, k: int, t: float) -> float:
    """Communication left showing when k transfers of c seconds each are paired with k
    equal slices of t seconds of compute, one per slice (DDP's buckets, ZeRO-3's prefetched
    units): one transfer always shows, each other one what it takes beyond its slice."""
    return c + (k - 1) * max(0.0, c - t / k)


def step_time(cfg: GPTConfig, strategy: str, n: int, hw: Hardware, micro_batch: int = 8,
              seq_len: int | None = None, elem_bytes: int = 2, bucket_MB: float = 25.0) -> dict:
    """Predicted seconds of one step on each of n GPUs, broken down."""
    T = seq_len or cfg.block_size
    compute = flops_per_token(cfg, T) * micro_batch * T / (hw.peak_flops * hw.mfu)
    fwd, bwd = compute / 3, 2 * compute / 3  # per parameter: 2 FLOPs forward, 4 backward
    psi = config_num_params(cfg)
    size = psi * elem_bytes  # the gradients (or parameters) in the wire's dtype
    if strategy in ("dp", "zero1", "zero2"):
        # buckets of about bucket_MB, as minidist.ddp.DDP and minidist.zero build them
        k = max(1, math.ceil(size / (bucket_MB * 2**20)))
        op = "all_reduce" if strategy == "dp" else "reduce_scatter"
        c = collective_time(op, size / k, n, hw)
        comm, exposed = k * c, exposed_time(c, k, bwd * hw.overlap)
        sent, messages = SENT_FRACTION[op](n) * size, k * MESSAGES[hw.latency][op](n)
        if strategy != "dp":
            # the updated shards are all-gathered after the step, before the next forward:
            # nothing left to hide behind
            gather = k * collective_time("all_gather", size / k, n, hw)
            comm, exposed = comm + gather, exposed + gather
            sent += SENT_FRACTION["all_gather"](n) * size
            messages += k * MESSAGES[hw.latency]["all_gather"](n)
    elif strategy == "zero3":
        L = cfg.n_layer
        g = collective_time("all_gather", size / L, n, hw)
        r = collective_time("reduce_scatter", size / L, n, hw)
        # forward: L gathers, each prefetched during the block before; backward: each
        # block is gathered again, and its gradients reduce-scattered once it is done
        comm = L * (2 * g + r)
        exposed = exposed_time(g, L, fwd * hw.overlap) + exposed_time(g + r, L, bwd * hw.overlap)
        sent = (2 * SENT_FRACTION["all_gather"](n) + SENT_FRACTION["reduce_scatter"](n)) * size
        messages = L * (2 * MESSAGES[hw.latency]["all_gather"](n) + MESSAGES[hw.latency]["reduce_scatter"](n))
    else:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    step = compute + exposed
    return dict(compute_s=compute, comm_s=comm, exposed_s=exposed, step_s=step,
                efficiency=compute / step, bytes_sent=sent, messages=messages,
                tokens_per_gpu=micro_batch * T)


def model_state_bytes(psi: float, n: int, stage: int, k: int = 12, p: int = 2, g: int = 2) -> float:
    """The ZeRO paper's model states per GPU (Rajbhandari et al., 2020, figure 1): p, g and
    K bytes per parameter of parameters, gradients and optimizer state, stage s sharding
    the first s of: optimizer state, gradients, parameters. An fp32 AdamW run: 4, 4, 8."""
    params, grads, state = p * psi, g * psi, k * psi
    if stage >= 1:
        state /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return params + grads + state


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """FLOPs of `steps` Newton-Schulz iterations on an m x n matrix (m <= n after the
    transpose): X X^T (2 m^2 n), A A (2 m^3), B X (2 m^2 n) per step (chapter 07)."""
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m**3)


# ------------------------------------------------------------ memory: one model, every size

# What a step keeps, derived in minidist/memory/estimate.py (chapter 09) and held to these
# formulas by tests/test_memory.py.
ELEM = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of autocast's dtype


def block_activation_bytes(B: int, T: int, d: int, H: int, precision: str = "fp32",
                           checkpointed: bool = False, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes one transformer block saves for backward (minidist/memory/estimate.py), on one
    of `tp` tensor-parallel ranks: the residual stream and the LayerNorms' (8d + 2ed + 16
    per token) stay whole, the rest splits tp ways; sequence parallelism splits all of it."""
    sp = tp if sequence_parallel else 1
    if checkpointed:
        return 4 * B * T * d // sp
    e = ELEM[precision]
    weights = 12 * e * d * d // tp if e < 4 else 0  # autocast's 16-bit weight copies
    whole, split = B * T * (8 * d + 2 * e * d + 16), B * T * (12 * e * d + 4 * H)
    return (whole + split) // tp + weights if sp > 1 else whole + split // tp + weights


def head_activation_bytes(B: int, T: int, d: int, V: int, precision: str = "fp32", tp: int = 1) -> int:
    """Bytes saved outside the blocks: indices, final LayerNorm, the head, the loss; with
    tensor parallelism the head and the softmax keep this rank's ceil(V / tp) words only."""
    e, V = ELEM[precision], -(-V // tp)
    weights = e * V * d if e < 4 else 0  # the head's 16-bit weight copy
    tokens = B * T * (8 + 8 + 4 * d + 8 + e * d + 4 * V)  # idx, targets, ln_f in/stats/out, log-softmax
    return tokens + 8 * T + weights


def activation_bytes(cfg: GPTConfig, B: int, T: int | None = None, precision: str = "bf16",
                     checkpointed: bool = False) -> int:
    """Everything the forward keeps for backward, one micro-batch of B sequences of T
    tokens (default: the context), flash attention (nothing T x T)."""
    T = T or cfg.block_size
    blocks = cfg.n_layer * block_activation_bytes(B, T, cfg.n_embd, cfg.n_head, precision, checkpointed)
    return blocks + head_activation_bytes(B, T, cfg.n_embd, cfg.vocab_size, precision)


def block_params(cfg: GPTConfig) -> int:
    d, b = cfg.n_embd, int(cfg.bias)
    return 12 * d * d + 2 * d * (1 + b) + (3 + 1 + 4 + 1) * d * b


def rank_params(cfg: GPTConfig, tp: int = 1, blocks: int | None = None, first: bool = True,
                last: bool = True) -> int:
    """Parameters on one rank: `blocks` blocks (default all) split tp ways (chapter 10's
    layout, tensor_parallel_cost.param_bytes), the embeddings if it is a pipeline's `first`
    stage, the final LayerNorm and a copy of the tied head if `last` (chapter 11)."""
    d, b, V = cfg.n_embd, int(cfg.bias), -(-cfg.vocab_size // tp)
    block = 12 * d * d // tp + 7 * d * b // tp + 2 * d * b + 2 * d * (1 + b)
    n = (cfg.n_layer if blocks is None else blocks) * block
    return n + (V * d if first or last else 0) + cfg.block_size * d * first + d * (1 + b) * last


def zero3_gathered_bytes(cfg: GPTConfig) -> float:
    """ZeRO-3's most gathered fp32 parameters at once: the root unit and two blocks (the
    one that runs and the one prefetched)."""
    block = 4 * block_params(cfg)
    return 4 * config_num_params(cfg) - cfg.n_layer * block + 2 * block


def memory_per_gpu(cfg: GPTConfig, strategy: str, n: int, micro_batch: int = 8,
                   precision: str = "bf16", checkpointed: bool = False) -> dict:
    """What each GPU holds through a train_gpt step: the model states (sharded per stage),
    one micro-batch's activations under autocast, ZeRO-3's gathered parameters. The parts
    of minidist.memory.step_memory, whose peak adds backward's transients."""
    psi, stage = config_num_params(cfg), STRATEGIES.index(strategy)
    state = model_state_bytes(psi, n, stage, k=8, p=4, g=4)
    act = activation_bytes(cfg, micro_batch, cfg.block_size, precision, checkpointed)
    total = state + act + (zero3_gathered_bytes(cfg) if stage == 3 else 0.0)
    return dict(state_GB=state / GB, activations_GB=act / GB, total_GB=total / GB,
                **{f"fits_{int(m)}GB": total <= m * GB for m in MEMORY_LIMITS_GB})


def predict(cfg: GPTConfig, strategy: str, n: int, hw: Hardware, micro_batch: int = 8) -> dict:
    return {**step_time(cfg, strategy, n, hw, micro_batch), **memory_per_gpu(cfg, strategy, n, micro_batch)}


def grad_sync_cost(cfg: GPTConfig, psi: float, dp: int, tp: int, pp: int, zero: int, m: int, compute: float,
                   hw: Hardware, bucket_cap_mb: float = 25.0) -> tuple[float, float]:
    """(bytes sent, exposed seconds) of one step's gradient sync over the dp group of psi
    fp32 gradients, whose ranks are tp apart (it spans dp x tp consecutive ranks), with
    `compute` seconds per micro-batch to hide behind (chapter 11's planner, appendix B)."""
    size, span, f = 4 * psi, dp * tp, (dp - 1) / dp
    if pp > 1:  # one flat all-reduce after the step; ZeRO-1 then all-gathers the updated shards
        t = collective_time("all_reduce", size, dp, hw, span)
        return (2 + zero) * f * size, t + zero * collective_time("all_gather", size, dp, hw, span)
    fwd, bwd = compute / 3 * hw.overlap, 2 * compute / 3 * hw.overlap  # the last micro-batch's
    sent = comm_volume(STRATEGIES[zero], psi, dp, elem_bytes=4, accum=m)  # as plan.comm_bytes
    if zero == 3:  # a gather per block forward and backward, a reduce-scatter, every micro-batch
        g, r = (collective_time(op, size / cfg.n_layer, dp, hw, span) for op in ("all_gather", "reduce_scatter"))
        return sent, m * (exposed_time(g, cfg.n_layer, fwd) + exposed_time(g + r, cfg.n_layer, bwd))
    k = max(1, math.ceil(size / (bucket_cap_mb * 2**20)))  # buckets, as DDP and ZeRO build them
    op = "all_reduce" if zero == 0 else "reduce_scatter"
    c = collective_time(op, size / k, dp, hw, span)
    hidden = exposed_time(c, k, bwd) * (m if zero == 2 else 1)  # ZeRO-2 reduces every micro-batch
    return sent, hidden + (k * collective_time("all_gather", size / k, dp, hw, span) if zero else 0)


# ------------------------------------------------------------ this machine, measured

def hardware_from_fit(fit: dict, n: int, peak_flops: float = 1.0, overlap: float = 0.0) -> Hardware:
    """A one-node 'cluster' whose links are the alpha and beta fit_alpha_beta measured here
    (bench_out/collectives.json). Overlap 0: on a CPU, communication and compute compete."""
    bw = 1 / fit["beta_s_per_byte"] / GB
    return Hardware(name=f"this machine, gloo, N={n}", peak_flops=peak_flops, mfu=1.0,
                    gpus_per_node=n, intra_GBps=bw, intra_alpha_s=fit["alpha_s"],
                    inter_GBps=bw, inter_alpha_s=fit["alpha_s"], overlap=overlap)


def scan(models: dict, ns: list[int], hw: Hardware, micro_batch: int = 8) -> list[dict]:
    """Every model x N x strategy, with the tree-latency efficiency beside the ring's."""
    tree = replace(hw, latency="tree")
    rows = []
    for label, cfg in models.items():
        for n in ns:
            for s in STRATEGIES:
                p = predict(cfg, s, n, hw, micro_batch)
                rows.append(dict(model=label, params=config_num_params(cfg), n=n, strategy=s, **p,
                                 efficiency_tree=step_time(cfg, s, n, tree, micro_batch)["efficiency"]))
    return rows
