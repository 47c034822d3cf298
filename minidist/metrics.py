"""Measuring a run: throughput, model FLOPs utilisation (MFU), memory.

Chapter 01 (chapters/01_gpt.md) defines MFU and validation bits per byte (computed by `minidist.train.evaluate`);
chapter 08 uses these figures at scale.
Exercised by `python -m minidist.train_gpt` (every log line) and tests/test_model.py.
Also what a run leaves: metrics.jsonl, written as it goes, and strict JSON throughout (a
NaN is written as null); and the watch that stops a run whose loss stays non-finite.

MFU = (model FLOPs per token * tokens per second) / (peak FLOP/s of the hardware). The
model FLOPs come from `minidist.model.flops_per_token`; the peak from the vendor's dense
(no sparsity) figure for the precision the matmuls run in. A CPU has no agreed peak, so on
CPU we measure one: the best rate of a large fp32 matmul on this process's threads. That
is an empirical ceiling, not a datasheet one, and the log says so.
"""

from __future__ import annotations

import json
import math
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


# ---- what a run writes: strict JSON, as it goes ------------------------------------

def finite_or_none(obj):
    """obj with every NaN or infinity replaced by None, in nested dicts and lists: JSON
    has no NaN, and strict parsers reject Python's "NaN" extension."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def to_json(obj, **kwargs) -> str:
    """Strict JSON: non-finite numbers as null (allow_nan=False proves none is left)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


class MetricsFile(list):
    """The log rows of a run, a list that also appends each row to `path` (metrics.jsonl)
    as it is added, flushed: a crash or a kill keeps every row logged so far. The file
    starts with `rows` (a resumed run's rows, restored from its checkpoint), so it always
    reads as one run. `write=False` (ranks other than 0): a plain list."""

    def __init__(self, path, rows=(), write: bool = True):
        super().__init__()
        self.file = open(path, "w") if write else None
        for row in rows:
            self.append(row)

    def append(self, row) -> None:
        super().append(row)
        if self.file:
            self.file.write(to_json(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


NONFINITE_STEPS = 3  # consecutive non-finite losses that stop a run


class NonFiniteLoss(RuntimeError):
    """The loss stayed NaN or infinite: training on would only write garbage."""


class LossWatch:
    """Stops a run (NonFiniteLoss) once the loss has been non-finite for NONFINITE_STEPS
    steps in a row. Every rank sees the same, all-reduced loss, so all stop at the same
    step. fp16's skipped steps do not count: an overflow there is in the scaled
    gradients, and the loss they report is finite."""

    def __init__(self, args):
        self.args, self.since = args, None  # the first step of the current bad streak

    def check(self, step: int, loss: float) -> None:
        if math.isfinite(loss):
            self.since = None
            return
        self.since = self.since or step
        if step - self.since + 1 >= NONFINITE_STEPS:
            a = self.args
            raise NonFiniteLoss(
                f"step {step}: the loss has been {loss} for {NONFINITE_STEPS} steps in a row "
                f"(steps {self.since}-{step}); stopping rather than training on garbage. Check "
                f"the learning rate (--lr {a.lr:g}, --warmup-steps {a.warmup_steps}), the "
                f"precision (--precision {a.precision}: fp16 can overflow, try bf16 or fp32) "
                f"and the data (token ids within the vocabulary of --tokenizer {a.tokenizer})")
