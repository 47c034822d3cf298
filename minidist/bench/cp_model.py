"""The cost model's prediction for context parallelism on GPUs, for `python -m minidist.bench cp`
to print beside what it measures on the CPU. Chapter 12 (chapters/12_context_parallel.md).
Exercised by `python -m minidist.bench cp --quick` (tests/test_bench.py).

One causal attention call, forward and backward, on the busiest rank of n GPUs:
  compute: score entries times FLOPs per entry at the Hardware's throughput (peak x MFU).
    A flash kernel skips the masked half of a diagonal tile, so a rank computes ring_work
    less half of each diagonal chunk pair; forward is 4D FLOPs an entry (Q K^T, P V),
    backward 10D (the scores again, then dV, dP, dQ, dK).
  ring, as minidist's ring is written: each forward hop (K, V: 2S) is posted before the
    step's compute and waited after it, so a step takes the longer of the two; backward
    hides its K, V hop the same way, but waits for the dK, dV hop (2S) after each step.
  allgather: the all-gather of K, V before the forward and the reduce-scatter of dK, dV
    after the backward, nothing to hide behind.
  ulysses: four all-to-alls of S each way (q, k, v, the output), none hidden; H/N heads of
    the whole sequence each, so the work is even, and n can be no more than the heads.
Messages cost alpha + bytes x beta on the slowest link the group spans (cost_model.link).
"""

from __future__ import annotations

from minidist.context_parallel import attention_bytes, attention_memory, ring_work, slice_bytes
from minidist.cost_model import GB, Hardware, collective_time, link

WAYS = (("ring", "contiguous"), ("ring", "zigzag"), ("allgather", "zigzag"), ("ulysses", "contiguous"))
# one attention layer of a 7B-class GPT (d = 4096: 32 heads of 128) in bf16, one sequence
AT_SCALE = dict(B=1, H=32, D=128, elem=2)
BESIDE_T = 131072  # the sequence of the column beside the CPU's measurements
SEQS = (8192, 32768, 131072, 524288)
GPUS = (8, 64)  # one node; eight nodes, more ranks than heads
FORWARD, BACKWARD = 4, 10  # FLOPs per score entry, in units of D


def flash_entries(T: int, n: int, rank: int, layout: str) -> int:
    """Score entries a flash kernel computes for `rank` (per batch row and head), causal."""
    m = 1 if layout == "contiguous" else 2  # diagonal chunk pairs this rank meets
    c = T // (n * m)
    return ring_work(T, n, rank, layout) - m * c * (c - 1) // 2 if n > 1 else T * (T + 1) // 2


def predict(way: str, layout: str, B: int, H: int, T: int, D: int, n: int, hw: Hardware,
            elem: int = 2) -> dict | None:
    """Predicted seconds of one attention forward + backward on the busiest of n GPUs, with
    the parts; None where the way cannot run (Ulysses with more ranks than heads)."""
    if way == "ulysses" and H % n:
        return None
    flops = hw.peak_flops * hw.mfu
    if way == "ulysses":
        entries = B * (H // n) * T * (T + 1) // 2
    else:
        entries = B * H * max(flash_entries(T, n, r, layout) for r in range(n))
    fwd, bwd = entries * FORWARD * D / flops, entries * BACKWARD * D / flops
    S = slice_bytes(B, H, T, D, n, elem)
    if n == 1:
        comm = exposed = 0.0
    elif way == "ring":
        alpha, beta = link(n, hw)
        hop = alpha + 2 * S * beta
        # n steps a pass; n - 1 of them wait for the longer of their compute and their hop
        step_f, step_b = fwd / n, bwd / n
        ring_f = (n - 1) * max(step_f, hop) + step_f
        ring_b = (n - 1) * max(step_b, hop) + step_b + n * hop
        comm = (3 * n - 2) * hop  # n - 1 K, V hops each pass, n dK, dV hops
        exposed = ring_f + ring_b - fwd - bwd
    else:
        if way == "allgather":  # minidist gathers by all-to-all: (n - 1) 2S each way
            parts = [collective_time("all_to_all", 2 * n * S, n, hw)] * 2
        else:  # four all-to-alls of S each way
            parts = [collective_time("all_to_all", S, n, hw)] * 8
        comm = exposed = sum(parts)
    step = fwd + bwd + exposed
    return dict(compute_s=fwd + bwd, comm_s=comm, exposed_s=exposed, step_s=step,
                sent_bytes=sum(attention_bytes(way, B, H, T, D, n, elem).values()),
                kv_bytes=attention_memory(way, B, H, T, D, n, elem, layout)["kv"])


def one_gpu(B: int, H: int, T: int, D: int, hw: Hardware) -> float:
    """SDPA (flash) on the whole sequence on one GPU: the oracle's predicted seconds."""
    return B * H * T * (T + 1) // 2 * (FORWARD + BACKWARD) * D / (hw.peak_flops * hw.mfu)


def vs_one_gpu(way: str, layout: str, n: int, hw: Hardware, T: int = BESIDE_T) -> float | None:
    """The predicted step on n GPUs over one GPU's SDPA on the whole sequence, for AT_SCALE's
    layer at T tokens: what the benchmark prints beside its CPU ratio (1/n is perfect)."""
    s = AT_SCALE
    p = predict(way, layout, s["B"], s["H"], T, s["D"], n, hw, s["elem"])
    return None if p is None else p["step_s"] / one_gpu(s["B"], s["H"], T, s["D"], hw)


def at_scale(hw: Hardware | None = None) -> list[dict]:
    """Every way at GPUS x SEQS on AT_SCALE's layer: predicted ms, and the winner per point."""
    hw = hw or Hardware()
    s = AT_SCALE
    rows = []
    for n in GPUS:
        for T in SEQS:
            row = dict(n=n, T=T, one_gpu_ms=1e3 * one_gpu(s["B"], s["H"], T, s["D"], hw))
            for way, layout in WAYS:
                p = predict(way, layout, s["B"], s["H"], T, s["D"], n, hw, s["elem"])
                key = way if way != "ring" else f"ring_{layout}"
                row[f"{key}_ms"] = None if p is None else 1e3 * p["step_s"]
                row[f"{key}_kv_GB"] = None if p is None else p["kv_bytes"] / GB
            times = {k[:-3]: v for k, v in row.items() if k.endswith("_ms") and k != "one_gpu_ms" and v is not None}
            row["fastest"] = min(times, key=times.get)
            rows.append(row)
    return rows
