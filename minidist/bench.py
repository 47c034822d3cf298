"""Benchmarks: `python -m minidist.bench NAME`, each comparing minidist with torch's own
implementation in the same run, as ratios (absolute times do not travel between
machines; ratios measured side by side do).

Chapter 02 (chapters/02_collectives.md) uses `collectives`, chapter 03 `ddp`, chapter 06
`zero` (minidist/bench_zero.py), chapter 07 `muon` (minidist/bench_muon.py); chapter 08
(chapters/08_at_scale.md) adds `scale` (minidist/bench_scale.py: the cost model of
minidist/cost_model.py from 8 to 1024 GPUs, no training) and `all` (minidist/bench_report.py:
every benchmark in turn, then one report.md with their tables, plots, the machine and the
date; the exit status is 1 if any of them failed).
Exercised by `python -m minidist.bench collectives --quick` (tests/test_bench.py) and
`python -m minidist.bench scale --quick` (tests/test_cost_model.py).

Each benchmark prints a table and writes NAME.json and NAME.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from minidist import comm
from minidist.launch import launch

# bytes each rank sends, as a fraction of the message size S, and ring steps (messages)
RING = {  # name: (bus-bandwidth factor f(N), steps(N))
    "all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all_gather": (lambda n: (n - 1) / n, lambda n: n - 1),
}


def _ours_and_theirs(op: str, S: int, device):
    """(ours, torch's) as zero-argument callables on fresh buffers of S bytes in total."""
    n = dist.get_world_size()
    numel = max(n, S // 4) // n * n  # fp32, divisible by the world size
    x = torch.ones(numel, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce(x), lambda: dist.all_reduce(x)
    part = torch.ones(numel // n, device=device)
    if op == "reduce_scatter":
        return (lambda: comm.reduce_scatter(part, x),
                lambda: dist.reduce_scatter_single(part, x))
    return lambda: comm.all_gather(x, part), lambda: dist.all_gather_single(x, part)


def _time_collectives(ops, sizes, budget_s):
    """On every rank: per (op, size), interleaved repetitions of ours and torch's; the
    time of a repetition is the slowest rank's. Returns rows on rank 0."""
    device = torch.device("cuda", dist.get_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for op in ops:
        for S in sizes:
            ours, theirs = _ours_and_theirs(op, S, device)
            times = {"ours": [], "torch": []}
            ours(), theirs()  # warm up: connections, allocations
            t_end, reps = time.perf_counter() + budget_s, 0
            while True:
                for name, fn in (("ours", ours), ("torch", theirs)) if reps % 2 else (("torch", theirs), ("ours", ours)):
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[name].append(time.perf_counter() - t0)
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


def collectives(args) -> dict:
    sizes = [2 ** k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
    worlds, ops, budget = args.world_sizes, args.ops, 1.0
    if args.quick:
        sizes, worlds, budget = [2 ** 10, 2 ** 16, 2 ** 20], [2], 0.05
    rows = []
    for n in worlds:
        rows += launch(_time_collectives, n, ops, sizes, budget, timeout_s=120)[0]
    for r in rows:
        f, _ = RING[r["op"]]
        for name in ("ours", "torch"):
            r[f"{name}_busbw_GBps"] = f(r["world_size"]) * r["bytes"] / r[f"{name}_s"] / 1e9
        r["ratio"] = r["ours_busbw_GBps"] / r["torch_busbw_GBps"]
    fits = {n: fit_alpha_beta([r for r in rows if r["world_size"] == n]) for n in worlds}
    print(f"{'op':15} {'N':>2} {'size':>9} {'ours ms':>9} {'torch ms':>9} "
          f"{'ours GB/s':>9} {'torch GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['op']:15} {r['world_size']:>2} {_size(r['bytes']):>9} {1e3 * r['ours_s']:9.3f} "
              f"{1e3 * r['torch_s']:9.3f} {r['ours_busbw_GBps']:9.3f} {r['torch_busbw_GBps']:10.3f} "
              f"{r['ratio']:6.2f}")
    for n, fit in fits.items():
        print(f"alpha-beta fit, N={n}: alpha = {1e6 * fit['alpha_s']:.1f} us per message, "
              f"1/beta = {fit['bandwidth_GBps']:.2f} GB/s per link")
    big = [r["ratio"] for r in rows if r["world_size"] == 2 and r["bytes"] >= 4 * 2 ** 20]
    if big:
        print(f"bus bandwidth ours/torch, N=2, >= 4 MiB: median {statistics.median(big):.2f}, "
              f"min {min(big):.2f}")
    result = {"rows": rows, "alpha_beta": {str(n): f for n, f in fits.items()},
              "backend": "nccl" if torch.cuda.is_available() else "gloo"}
    _plot_collectives(rows, fits, Path(args.out) / "collectives.png")
    return result


def _size(b: int) -> str:
    return f"{b // 2 ** 20} MiB" if b >= 2 ** 20 else f"{b // 2 ** 10} KiB"


def _plot_collectives(rows, fits, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- ddp

def _time_ddp(variants, steps, rounds, cfg_kw, per_rank_batch, seq_len):
    """Per variant, the median step time (forward, backward, sync, AdamW step) on the same
    model and data; variants interleaved in rounds so drift in machine load hits all."""
    import contextlib

    from minidist.ddp import DDP, allreduce_gradients_flat, allreduce_gradients_naive
    from minidist.model import GPT, GPTConfig
    device = torch.device("cuda", dist.get_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    x = torch.randint(0, cfg.vocab_size, (per_rank_batch, seq_len), device=device)
    runners = {}
    for name in variants:
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        post, ctx = (lambda: None), contextlib.nullcontext
        if name == "torch_ddp":
            fwd = torch.nn.parallel.DistributedDataParallel(model)
        elif name.startswith("bucketed"):  # bucketed:<cap MB|None>[:no_overlap]
            parts = name.split(":")
            cap = None if parts[1] == "None" else float(parts[1])
            fwd = DDP(model, bucket_cap_mb=cap, overlap=len(parts) < 3)
        else:
            fwd = model
            post = {"naive": lambda m=model: allreduce_gradients_naive(m),
                    "flat": lambda m=model: allreduce_gradients_flat(m)}.get(name, post)
            if name == "no_comm":  # compute only: what a step costs with nothing to send
                ctx = DDP(model).no_sync
        runners[name] = (fwd, opt, post, ctx)

    def step(name):
        fwd, opt, post, ctx = runners[name]
        with ctx():
            fwd(x, x)[1].backward()
        post()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = {n: [] for n in variants}
    for n in variants:
        step(n)  # warm up
    for _ in range(rounds):
        for n in variants:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(n)
            sync()
            times[n].append((time.perf_counter() - t0) / steps)
    return {n: statistics.median(t) for n, t in times.items()} if dist.get_rank() == 0 else None


def ddp(args) -> dict:
    from minidist.model import PRESETS
    from minidist.flags import AUTO
    cfg_kw = dict(PRESETS["tiny"], vocab_size=2048)  # train_gpt's CPU default model
    world, steps, rounds = 2, 2, 12  # many short rounds: load drifts hit every variant alike
    global_batch, seq_len = AUTO["cpu"]["batch_size"], cfg_kw["block_size"]
    caps = ["0", "0.25", "0.5", "1", "2", "None"]
    if args.quick:
        cfg_kw.update(n_layer=2, n_embd=64, n_head=2)
        steps, rounds, caps = 1, 2, ["0", "1", "None"]
    variants = (["naive", "flat", "torch_ddp", "no_comm", "bucketed:1:no_overlap"]
                + [f"bucketed:{c}" for c in caps])
    t = launch(_time_ddp, world, variants, steps, rounds, cfg_kw, global_batch // world, seq_len,
               timeout_s=300)[0]
    best = min(caps, key=lambda c: t[f"bucketed:{c}"])
    exposed = {"without overlap": t["bucketed:1:no_overlap"] - t["no_comm"],
               "with overlap": t["bucketed:1"] - t["no_comm"]}
    hidden = 1 - exposed["with overlap"] / exposed["without overlap"] if exposed["without overlap"] > 0 else None
    print(f"default GPT (tiny, vocab 2048), {world} ranks, {global_batch} x {seq_len} tokens per step; "
          f"median of {rounds} rounds x {steps} steps")
    print(f"{'variant':26} {'step ms':>8} {'vs torch DDP':>12}")
    for n in variants:
        print(f"{n:26} {1e3 * t[n]:8.1f} {t[n] / t['torch_ddp']:12.3f}")
    print(f"best bucket cap: {best} MB ({t[f'bucketed:{best}'] / t['torch_ddp']:.3f}x torch DDP); "
          f"communication exposed: {1e3 * exposed['without overlap']:.1f} ms without overlap, "
          f"{1e3 * exposed['with overlap']:.1f} ms with (1 MB buckets)"
          + (f": {100 * hidden:.0f}% hidden behind backward" if hidden is not None and hidden >= 0 else
             ": none hidden (the overlapped run was the slower one: noise)" if hidden is not None else ""))
    result = {"step_s": t, "best_cap_mb": best, "exposed_comm_s": exposed, "hidden_fraction": hidden,
              "ratio_vs_torch_ddp": {n: t[n] / t["torch_ddp"] for n in variants}}
    _plot_ddp(t, caps, Path(args.out) / "ddp.png")
    return result


def _plot_ddp(t, caps, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [0.05 if c == "0" else 8.0 if c == "None" else float(c) for c in caps]
    ax.plot(xs, [1e3 * t[f"bucketed:{c}"] for c in caps], "o-", label="minidist DDP (bucketed)")
    for n, style in (("torch_ddp", "--"), ("naive", ":"), ("flat", "-."), ("no_comm", "-")):
        ax.axhline(1e3 * t[n], ls=style, color="gray" if n == "no_comm" else None, label=n)
    ax.set(xscale="log", xlabel="bucket cap (MB; left: one per parameter, right: one bucket)",
           ylabel="step time (ms)", title="data parallel step time, 2 ranks")
    ax.legend(fontsize=8), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def muon(args) -> dict:
    from minidist.bench_muon import muon as run  # its own module: chapter 07's measurements
    return run(args)


def zero(args) -> dict:
    from minidist.bench_zero import zero as run  # its own module: chapter 06's measurements
    return run(args)


def scale(args) -> dict:
    from minidist.bench_scale import scale as run  # chapter 08's cost model, no processes
    return run(args)


def all_benchmarks(args) -> dict:
    from minidist.bench_report import run_all  # every benchmark above, then report.md
    return run_all(args)


BENCHMARKS = {"collectives": collectives, "ddp": ddp, "muon": muon, "zero": zero, "scale": scale,
              "all": all_benchmarks}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minidist.bench", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("--out", default="bench_out", help="folder for NAME.json and NAME.png")
    p.add_argument("--quick", action="store_true", help="a few sizes, one world size (smoke test)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ops", nargs="+", default=list(RING), choices=list(RING))
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = BENCHMARKS[args.name](args)
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}/{args.name}.json and {args.out}/{args.name}.png")


if __name__ == "__main__":
    main()
