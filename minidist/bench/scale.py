"""`python -m minidist.bench scale`: what minidist.cost_model predicts for data parallelism
and ZeRO-1/2/3 from 8 to 1024 GPUs. Chapter 08 (chapters/08_at_scale.md). Exercised by
`python -m minidist.bench scale --quick` (tests/test_cost_model.py).

No processes: model x N x strategy, weak scaling (MICRO_BATCH sequences of 1024 tokens per
GPU): step time, exposed communication, efficiency (ring and tree latencies), memory per GPU
against 80 and 141 GB. Then the same model with this machine's alpha and beta
(collectives.json in --out) against what `ddp` and `zero` measured, where their JSON is there.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from minidist.cost_model import (MEMORY_LIMITS_GB, MODELS, STRATEGIES, Hardware, collective_time, exposed_time,
                                 hardware_from_fit, scan, step_time)
from minidist.bench import cpu_default
from minidist.bench.report import pyplot, save_figure
from minidist.model import GPTConfig, config_num_params

MICRO_BATCH = 8  # sequences per GPU per step: 8192 tokens
NAMES = {"dp": "DP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def _fits(r) -> str:
    return "/".join("yes" if r[f"fits_{int(m)}GB"] else "no" for m in MEMORY_LIMITS_GB)


def markdown_table(rows) -> str:
    head = ("| model | N | strategy | step ms | exposed comm ms | efficiency (ring) | efficiency (tree) "
            "| model state GB/GPU | total GB/GPU | fits 80/141 GB |")
    lines = [head, "|" + "---|" * 3 + "---:|" * 6 + "---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['n']} | {NAMES[r['strategy']]} | {1e3 * r['step_s']:.1f} "
                     f"| {1e3 * r['exposed_s']:.1f} | {100 * r['efficiency']:.1f}% "
                     f"| {100 * r['efficiency_tree']:.1f}% | {r['state_GB']:.2f} | {r['total_GB']:.1f} | {_fits(r)} |")
    return "\n".join(lines)


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def compare_with_measured(out: Path) -> list[dict]:
    """The model with this machine's alpha and beta against what the other benchmarks
    measured here, where their JSON is in `out`: ddp.json's exposed communication (N = 2,
    1 MB buckets, with and without overlap) and zero.json's step time of each stage over
    stage 0's. Only differences of step time: compute comes from the measurement itself (a
    CPU has no agreed peak). bench zero times gloo, whose reduce-scatter sends an all-reduce's
    bytes (chapter 02), against alpha and beta fitted on our rings: expect the model to
    under-predict stages 2 and 3 a little."""
    fits = (_load(out / "collectives.json") or {}).get("alpha_beta")
    if not fits:
        return []
    tiny = GPTConfig(**cpu_default(quick=False)[0])  # what bench ddp and zero train
    psi, rows = config_num_params(tiny), []
    ddp = _load(out / "ddp.json")
    if ddp and "2" in fits:
        t, hw = ddp["step_s"], hardware_from_fit(fits["2"], 2)
        k = math.ceil(4 * psi / 2**20)  # 1 MB buckets of fp32 gradients
        c = collective_time("all_reduce", 4 * psi / k, 2, hw)
        bwd = 2 / 3 * t["no_comm"]
        rows.append(dict(what="DDP exposed comm, N=2, no overlap (ms)", measured=1e3 * (t["bucketed:1:no_overlap"] - t["no_comm"]),
                         model=1e3 * k * c))
        rows.append(dict(what="DDP exposed comm, N=2, overlap (ms)", measured=1e3 * (t["bucketed:1"] - t["no_comm"]),
                         model=1e3 * exposed_time(c, k, bwd)))
    zero = _load(out / "zero.json")
    for n, run in (zero or {}).get("runs", {}).items():
        if n not in fits or set(run["step_s"]) < {"stage0", "stage1", "stage2", "stage3"}:
            continue
        hw = hardware_from_fit(fits[n], int(n))
        cfg = GPTConfig(**zero["config"])
        comm = {s: step_time(cfg, s, int(n), hw, elem_bytes=4)["exposed_s"] for s in STRATEGIES}
        compute = run["step_s"]["stage0"] - comm["dp"]
        for i, s in enumerate(STRATEGIES[1:], 1):
            rows.append(dict(what=f"ZeRO-{i} step / stage 0, N={n}",
                             measured=run["step_s"][f"stage{i}"] / run["step_s"]["stage0"],
                             model=(compute + comm[s]) / (compute + comm["dp"])))
    return rows


def run(args) -> dict:
    hw = Hardware()
    models = {k: MODELS[k] for k in ("124M", "7B")} if args.quick else MODELS
    ns = [8, 64, 1024] if args.quick else [2 ** k for k in range(3, 11)]
    rows = scan(models, ns, hw, MICRO_BATCH)
    print(f"{hw.name}; {hw.peak_flops / 1e12:.0f} TFLOP/s at MFU {hw.mfu:.0%}; links "
          f"{hw.intra_GBps:.0f} GB/s + {1e6 * hw.intra_alpha_s:.0f} us inside a node, "
          f"{hw.inter_GBps:.0f} GB/s + {1e6 * hw.inter_alpha_s:.0f} us between nodes")
    print(f"weak scaling: {MICRO_BATCH} x 1024 tokens per GPU per step; bf16 on the wire; "
          "25 MB buckets for DP and ZeRO-1/2; efficiency = one GPU's compute-only step / step on N")
    print("memory per GPU: minidist's step (fp32 weights and gradients, AdamW, 4 + 4 + 8 bytes per parameter "
          "sharded per stage) and one micro-batch's bf16-autocast activations, as minidist.memory counts them")
    for label, cfg in models.items():
        p = next(r["params"] for r in rows if r["model"] == label)
        print(f"  {label}: {p / 1e9:.3f}B parameters, {cfg.n_layer} layers, {cfg.n_embd} wide")
    table = markdown_table(rows)
    print(table)
    key = {}
    for label in models:
        for n in (64, 1024):
            rs = {r["strategy"]: r for r in rows if r["model"] == label and r["n"] == n}
            if rs:
                key[f"{label} N={n}"] = {f"{NAMES[s]} {lat}": r["efficiency" + suffix] for s, r in rs.items()
                                         for lat, suffix in (("ring", ""), ("tree", "_tree"))}
                print(f"{label:>5} at N={n:4d}: efficiency (ring, tree) " + ", ".join(
                    f"{NAMES[s]} {rs[s]['efficiency']:.1%}, {rs[s]['efficiency_tree']:.1%}" for s in ("dp", "zero1", "zero3")))
    measured = compare_with_measured(Path(args.out))
    if measured:
        print("\nThe model with this machine's alpha and beta (collectives.json) against measurements here:")
        print(f"{'':46} {'measured':>9} {'model':>9}")
        for m in measured:
            print(f"{m['what']:46} {m['measured']:9.3f} {m['model']:9.3f}")
    else:
        print(f"\n(no {args.out}/collectives.json: run `python -m minidist.bench collectives` first "
              "to compare the model with this machine)")
    _plot(rows, models, ns, Path(args.out) / "scale.png")
    return {"hardware": asdict(hw), "micro_batch": MICRO_BATCH, "seq_len": 1024, "rows": rows,
            "key_efficiency": key, "measured_vs_model": measured, "table_md": table}


def _plot(rows, models, ns, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7.5), squeeze=False)
    for col, label in enumerate(models):
        eff_ax, mem_ax = axes[0][col], axes[1][col]
        for i, s in enumerate(STRATEGIES):
            rs = [r for r in rows if r["model"] == label and r["strategy"] == s]
            color, size = f"C{i}", 9 if s == "zero1" else 5  # ZeRO-1 runs as ZeRO-2: keep it visible
            eff_ax.plot(ns, [r["efficiency"] for r in rs], "o-", ms=size, color=color, label=f"{NAMES[s]} (ring)")
            eff_ax.plot(ns, [r["efficiency_tree"] for r in rs], ":", color=color, label=f"{NAMES[s]} (tree)")
            mem_ax.plot(ns, [r["total_GB"] for r in rs], "o-", ms=size, color=color, label=NAMES[s])
        for limit in MEMORY_LIMITS_GB:
            mem_ax.axhline(limit, color="gray", lw=0.8, ls="--")
        eff_ax.set(xscale="log", ylim=(0, 1.05), xlabel="GPUs", ylabel="scaling efficiency",
                   title=f"{label}: efficiency (weak scaling)")
        top = max([160.0] + [1.1 * r["total_GB"] for r in rows if r["model"] == label])
        mem_ax.set(xscale="log", ylim=(0, top), xlabel="GPUs", ylabel="GB per GPU (dashed: 80, 141)",
                   title=f"{label}: memory per GPU")
        for ax in (eff_ax, mem_ax):
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    save_figure(fig, path)
