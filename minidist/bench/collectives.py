"""`python -m minidist.bench collectives`: minidist's ring collectives against torch's, on
the same buffers in the same processes. Chapter 02 (chapters/02_collectives.md).
Exercised by `python -m minidist.bench collectives --quick` (tests/test_bench.py).

Per collective and size, on 2 and 4 ranks: ours and torch's, interleaved, their bus
bandwidths and ratio (all_reduce: chapter 02's plain ring; all_reduce_pipelined:
minidist.comm's segmented one); then alpha and beta, fitted to our rows of one world size.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from minidist import comm
from minidist.bench import rank_device
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import timer
from minidist.cost_model import MESSAGES, SENT_FRACTION
from minidist.launch import launch

# Per collective: (the bytes each rank sends as a fraction of the message, its messages one
# after another), chapter 02's formulas; the pipelined all-reduce sends what the plain one does.
_FORMULA = {"all_reduce": "all_reduce", "all_reduce_pipelined": "all_reduce",
            "reduce_scatter": "reduce_scatter", "all_gather": "all_gather"}
RING = {op: (SENT_FRACTION[f], MESSAGES["ring"][f]) for op, f in _FORMULA.items()}


def _ours_and_theirs(op: str, S: int, device):
    """(ours, torch's) as zero-argument callables on fresh buffers of S bytes in total."""
    n = dist.get_world_size()
    numel = max(n, S // 4) // n * n  # fp32, divisible by the world size
    x = torch.ones(numel, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce(x), lambda: dist.all_reduce(x)
    if op == "all_reduce_pipelined":
        return lambda: comm.all_reduce_pipelined(x), lambda: dist.all_reduce(x)
    part = torch.ones(numel // n, device=device)
    if op == "reduce_scatter":
        return (lambda: comm.reduce_scatter(part, x),
                lambda: dist.reduce_scatter_single(part, x))
    return lambda: comm.all_gather(x, part), lambda: dist.all_gather_single(x, part)


def _time_collectives(ops, sizes, budget_s):
    """On every rank: per (op, size), interleaved repetitions of ours and torch's, each one
    call timed by minidist.bench.timing (a barrier before it, Timer's warm-up, then the
    call); the time of a repetition is the slowest rank's. Returns rows on rank 0."""
    device = rank_device()
    rows = []
    for op in ops:
        for S in sizes:
            ours, theirs = _ours_and_theirs(op, S, device)
            timers = {"ours": timer(ours, before=dist.barrier), "torch": timer(theirs, before=dist.barrier)}
            times = {"ours": [], "torch": []}
            t_end, reps = time.perf_counter() + budget_s, 0  # a budget, not a measurement
            while True:
                for name in ("ours", "torch") if reps % 2 else ("torch", "ours"):
                    times[name].append(timers[name].timeit(1).times[0])
                reps += 1
                # every rank must take the same decision to go on, or they would deadlock:
                # stop when any rank's time is up (at least 3 repetitions, at most 50)
                flag = torch.tensor([float(time.perf_counter() < t_end)])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                if reps >= 50 or (reps >= 3 and flag.item() == 0):
                    break
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, times)
            row = {"op": op, "bytes": S, "world_size": dist.get_world_size(), "reps": reps}
            for name in times:
                slowest = [max(g[name][i] for g in gathered) for i in range(reps)]
                row[f"{name}_s"] = statistics.median(slowest)
            rows.append(row)
    return rows if dist.get_rank() == 0 else None


def fit_alpha_beta(rows) -> dict:
    """Least-squares fit of t = alpha * messages + beta * bytes sent per rank over our
    ring collectives: alpha is the per-message latency, 1/beta the link bandwidth."""
    A, t = [], []
    for r in rows:
        f, steps = RING[r["op"]]
        n = r["world_size"]
        A.append([steps(n), f(n) * r["bytes"]])
        t.append(r["ours_s"])
    A, t = np.array(A), np.array(t)
    (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    if alpha < 0 or beta < 0:  # noise pushed one below zero: the best fit with it at zero
        fits = [(max(0.0, A[:, 0] @ t / (A[:, 0] @ A[:, 0])), 0.0),
                (0.0, max(0.0, A[:, 1] @ t / (A[:, 1] @ A[:, 1])))]
        alpha, beta = min(fits, key=lambda ab: float(np.sum((A @ np.array(ab) - t) ** 2)))
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "bandwidth_GBps": float(1 / beta / 1e9) if beta > 0 else float("inf")}


def run(args) -> dict:
    sizes = [2 ** k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
    worlds, ops, budget = args.world_sizes, args.ops, 1.0
    if args.quick:
        sizes, worlds, budget = [2 ** 10, 2 ** 16, 2 ** 20], [2], 0.05
    rows = []
    for n in worlds:
        rows += launch(_time_collectives, n, ops, sizes, budget, timeout_s=120, device="auto")[0]
    for r in rows:
        f, _ = RING[r["op"]]
        for name in ("ours", "torch"):
            r[f"{name}_busbw_GBps"] = f(r["world_size"]) * r["bytes"] / r[f"{name}_s"] / 1e9
        r["ratio"] = r["ours_busbw_GBps"] / r["torch_busbw_GBps"]
    fits = {n: fit_alpha_beta([r for r in rows if r["world_size"] == n]) for n in worlds}
    print(f"{'op':21} {'N':>2} {'size':>9} {'ours ms':>9} {'torch ms':>9} "
          f"{'ours GB/s':>9} {'torch GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['op']:21} {r['world_size']:>2} {_size(r['bytes']):>9} {1e3 * r['ours_s']:9.3f} "
              f"{1e3 * r['torch_s']:9.3f} {r['ours_busbw_GBps']:9.3f} {r['torch_busbw_GBps']:10.3f} "
              f"{r['ratio']:6.2f}")
    for n, fit in fits.items():
        print(f"alpha-beta fit, N={n}: alpha = {1e6 * fit['alpha_s']:.1f} us per message, "
              f"1/beta = {fit['bandwidth_GBps']:.2f} GB/s per link")
    for op in ops:
        big = [r["ratio"] for r in rows if r["op"] == op and r["world_size"] == 2 and r["bytes"] >= 4 * 2 ** 20]
        if big:
            print(f"bus bandwidth ours/torch, {op}, N=2, >= 4 MiB: median {statistics.median(big):.2f}, "
                  f"min {min(big):.2f}")
    result = {"rows": rows, "alpha_beta": {str(n): f for n, f in fits.items()},
              "backend": "nccl" if torch.cuda.is_available() else "gloo"}
    _plot_collectives(rows, fits, Path(args.out) / "collectives.png")
    return result


def _size(b: int) -> str:
    return f"{b // 2 ** 20} MiB" if b >= 2 ** 20 else f"{b // 2 ** 10} KiB"


def _plot_collectives(rows, fits, path) -> None:
    plt = pyplot()
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for n in sorted({r["world_size"] for r in rows}):
            rs = [r for r in rows if r["op"] == op and r["world_size"] == n]
            x = [r["bytes"] for r in rs]
            ax.plot(x, [r["ours_busbw_GBps"] for r in rs], "o-", label=f"minidist N={n}")
            ax.plot(x, [r["torch_busbw_GBps"] for r in rs], "s--", label=f"torch N={n}")
            f, steps = RING[op]
            a, b = fits[n]["alpha_s"], fits[n]["beta_s_per_byte"]
            ax.plot(x, [f(n) * s / (steps(n) * a + f(n) * s * b) / 1e9 for s in x], ":",
                    color="gray", label=f"alpha-beta N={n}")
        ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title=op)
        ax.grid(alpha=0.3), ax.legend(fontsize=7)
    save_figure(fig, path)
