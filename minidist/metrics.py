"""Measuring a run: throughput, model FLOPs utilisation (MFU), memory.

Chapter 01 (chapters/01_gpt.md) defines MFU and validation bits per byte (computed by `minidist.train.evaluate`);
chapter 08 uses these figures at scale.
Exercised by `python -m minidist.train_gpt` (every log line) and tests/test_model.py.

MFU = (model FLOPs per token * tokens per second) / (peak FLOP/s of the hardware). The
model FLOPs come from `minidist.model.flops_per_token`; the peak from the vendor's dense
(no sparsity) figure for the precision the matmuls run in. A CPU has no agreed peak, so on
CPU we measure one: the best rate of a large fp32 matmul on this process's threads. That
is an empirical ceiling, not a datasheet one, and the log says so.
"""

from __future__ import annotations

import resource
import sys
import time

import torch


# Dense peak TFLOP/s from the vendors' datasheets (SXM parts), by precision of the matmul.
# "fp32" means TF32 tensor cores where the GPU has them, as torch uses for fp32 matmuls
# when torch.backends.cuda.matmul.allow_tf32 is set.
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
}

_measured_cpu_peak: float | None = None


def gpu_peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """Datasheet peak in FLOP/s for a GPU whose name contains a key of PEAK_TFLOPS."""
    for key, table in PEAK_TFLOPS.items():
        if key in device_name.upper():
            return table[precision] * 1e12
    return None


def measure_cpu_peak_flops(n: int = 512, seconds: float = 0.5) -> float:
    """Best fp32 matmul rate of this process (FLOP/s), measured once and remembered."""
    global _measured_cpu_peak
    if _measured_cpu_peak is None:
        a, b = torch.randn(n, n), torch.randn(n, n)
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
        _measured_cpu_peak = best
    return _measured_cpu_peak


def peak_flops(device: torch.device, precision: str = "fp32") -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, precision)
        return peak, (f"{name} datasheet {precision}" if peak else f"{name}: not in the peak table")
    return measure_cpu_peak_flops(), "measured fp32 matmul peak of this CPU process"


def mfu(flops_per_token: float, tokens_per_s: float, peak_per_device: float | None,
        n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None when the peak is unknown."""
    if not peak_per_device:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * n_devices)


def memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class Throughput:
    """Tokens per second over the steps since the last call to `rate()`."""

    def __init__(self):
        self.tokens, self.t0 = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        r = self.tokens / dt if dt > 0 else 0.0
        self.tokens, self.t0 = 0, time.perf_counter()
        return r


def plot_losses(rows, path) -> None:
    """Train and validation loss against step, saved to `path` (a Figure of its own: no
    pyplot, so a notebook's backend is left as it was)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    ax.plot(*zip(*tr), label="train")
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="minidist train_gpt")
    ax.legend(), ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
