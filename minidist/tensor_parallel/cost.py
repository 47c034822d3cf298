"""Tensor parallelism's closed forms: bytes per step, parameter and activation bytes per
rank (ours, exact, and Korthikanti et al.'s), and the step time the cost model predicts
for a GPU node. Chapter 10 (chapters/10_tensor_parallel.md). Exercised by
`pytest -q tests/test_tensor_parallel.py` (every formula against a count of the real run)
and `python -m minidist.bench tp` (measured beside predicted).
"""

from __future__ import annotations

from minidist.cost_model import MESSAGES, SENT_FRACTION, Hardware, link
from minidist.model import flops_per_token
from minidist.tensor_parallel.layers import shard_range


def comm_bytes(cfg, B: int, T: int, tp: int, sequence_parallel: bool = False, elem: int = 4) -> dict:
    """Bytes one forward + backward of B sequences of T tokens hands to each collective on
    each rank (all-reduce: the tensor; all-gather: its output; reduce-scatter: its input),
    and "sent", what a ring puts on the wire. Per layer 4 all-reduces of B T C elements,
    plus the embedding's, the head's and the loss's 3 of B T; under sequence parallelism
    each becomes an all-gather and a reduce-scatter (the same bytes sent), regathering adds
    one all-gather per column-parallel layer, and used_on_positions one all-reduce per use."""
    if tp == 1:
        return dict(all_reduce=0, all_gather=0, reduce_scatter=0, sent=0.0)
    N, C, L, b = B * T, cfg.n_embd, cfg.n_layer, int(cfg.bias)
    act = N * C * elem
    out = dict(all_reduce=3 * N * 4, all_gather=0, reduce_scatter=0)  # the loss, fp32
    if not sequence_parallel:
        out["all_reduce"] += (4 * L + 2) * act
    else:
        out["reduce_scatter"] = (4 * L + 2) * act
        out["all_gather"] = (4 * L + 2 + 2 * L + 1) * act  # 2 L + 1: the regathers
        replicated = cfg.block_size * C + L * (2 * C * (1 + b) + 2 * C * b) + C * (1 + b)
        out["all_reduce"] += replicated * 4  # fp32 gradients
    out["sent"] = sum(SENT_FRACTION[k](tp) * v for k, v in out.items())
    return out


def param_bytes(cfg, tp: int, rank: int = 0, elem: int = 4) -> int:
    """Bytes of one rank's parameters: the split matrices and their split biases / tp,
    the vocabulary rows of its range, the replicated rest (layer norms, wpe, the
    row-parallel biases) whole."""
    C, L, b = cfg.n_embd, cfg.n_layer, int(cfg.bias)
    start, stop = shard_range(cfg.vocab_size, rank, tp)
    block = 12 * C * C // tp + 7 * C * b // tp + 2 * C * b + 2 * C * (1 + b)
    return elem * ((stop - start) * C + cfg.block_size * C + L * block + C * (1 + b))


def tp_block_activation_bytes(B: int, T: int, d: int, H: int, tp: int = 1,
                              sequence_parallel: bool = False) -> int:
    """Bytes one ParallelBlock saves for backward, fp32, dropout off (chapter 09's count,
    minidist.memory.block_activation_bytes, is the tp = 1 case: B T (64 d + 4 H + 16)).

    Per token, replicated: the input, the residual, the two LayerNorms' outputs and
    statistics, 16 d + 16; split t ways: q k v, attention output, MLP hidden and GELU,
    SDPA's logsumexp, (48 d + 4 H) / t. Sequence parallelism splits all of it: all / t."""
    if not sequence_parallel:
        return B * T * (16 * d + 16) + B * T * (48 * d + 4 * H) // tp
    return B * T * (64 * d + 4 * H + 16) // tp


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                                 sequence_parallel: bool = False) -> float:
    """Korthikanti et al. (2022), bytes per layer, 16-bit activations, 1-byte dropout masks:
    s b h (34 + 5 a s / h); tensor-parallel s b h (10 + 24/t + 5 a s / (h t)); with
    sequence parallelism s b h / t (34 + 5 a s / h).

    Ours differs (no dropout masks, SDPA stores no a s^2 scores, fp32, LayerNorm's
    statistics counted): ours / theirs -> 64 / 34 for short sequences, far below 1 for long."""
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def tp_step_time(cfg, B: int, T: int, tp: int, hw: Hardware | None = None) -> dict:
    """Predicted seconds of one forward + backward of B sequences of T tokens at tp `tp` on
    a GPU node (bf16), the communication exposed (tensor parallelism's all-reduces sit on
    the critical path: the next matmul needs their result): compute = the model's FLOPs / tp
    at the hardware's peak x MFU; communication = each all-reduce's messages x alpha plus
    the bytes a ring sends x beta (comm_bytes, elem 2), over the node's links (link)."""
    hw = hw or Hardware()
    compute = flops_per_token(cfg, T) * B * T / tp / (hw.peak_flops * hw.mfu)
    comm = 0.0
    if tp > 1:
        alpha, beta = link(tp, hw)
        n_all_reduce = 4 * cfg.n_layer + 2 + 3  # per layer 4, the embedding and the head, the loss
        comm = n_all_reduce * MESSAGES[hw.latency]["all_reduce"](tp) * alpha \
            + comm_bytes(cfg, B, T, tp, elem=2)["sent"] * beta
    return dict(compute_s=compute, comm_s=comm, step_s=compute + comm)
