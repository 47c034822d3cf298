"""Measuring a run: throughput, model FLOPs utilisation (MFU), memory.

Chapter 01 (chapters/01_gpt.md) defines MFU. Exercised by `python -m minidist.train_gpt`
(every log line) and tests/test_model.py. MFU = model FLOPs per token * tokens per second
/ the hardware's dense peak FLOP/s for the matmuls' precision. A CPU has no agreed peak, so
on CPU we measure one (the best rate of a large fp32 matmul): the log says so.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import Counter
from contextlib import contextmanager

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
        from torch.utils.benchmark import Timer  # blocks of matmuls for `seconds`, all threads
        timer = Timer("a @ b", globals={"a": torch.randn(n, n), "b": torch.randn(n, n)},
                      num_threads=torch.get_num_threads())
        _measured_cpu_peak = 2 * n**3 / min(timer.blocked_autorange(min_run_time=seconds).times)
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


def mfu_text(m: float | None) -> str:
    """MFU for the log: "4.5%", "n/a" without a peak, and above 100% said to be what it is: a
    peak measured low (on a CPU, while something else held the cores), not work beyond it."""
    if m is None:
        return "n/a"
    return f"{100 * m:.1f}%" + (" (above the measured peak: it was measured low)" if m > 1 else "")


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


class Tallies:
    """Counters that code adds to while they are open: `with tallies.counting() as c:` opens
    one (they nest, and every open one counts), `tallies.add(name, n)` adds n to each.
    minidist.comm.count_bytes and minidist.context_parallel.count_work are two of them."""

    def __init__(self):
        self.open: list[Counter] = []

    @contextmanager
    def counting(self):
        c = Counter()
        self.open.append(c)
        try:
            yield c
        finally:  # by identity: list.remove compares Counters by value, and two may be equal
            del self.open[next(i for i, o in enumerate(self.open) if o is c)]

    def add(self, name: str, n: int) -> None:
        for c in self.open:
            c[name] += n
