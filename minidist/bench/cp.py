"""`python -m minidist.bench cp`: context parallelism's three ways at cp 1, 2 and 4 on one
long sequence, measured against their closed forms and against SDPA on one process, beside
the cost model's prediction for a GPU node. Chapter 12 (chapters/12_context_parallel.md,
which reads the table). Exercised by `python -m minidist.bench cp --quick` (tests/test_bench.py).

One causal attention of B x H heads x T tokens x D, fp32, cut over cp ranks (a process each,
minidist.launch): the ring with contiguous and with zigzag slices, the all-gather of K, V
(zigzag, as Llama 3 balances it) and Ulysses. Per way and cp, on every rank:
  outputs and the gradients of q, k, v against the matching slices of SDPA on the whole
    sequence (TOL, fp32);
  bytes sent, counted by comm.count_bytes, against work.attention_bytes;
  the forward's peak of live tensor bytes (minidist.memory.measure_peak, chapter 09's
    counter: this rank's q, k, v and everything the call allocates) against
    work.attention_memory, which counts K, V and one score matrix;
  the ring's score entries, counted by work.count_work, against ring_work, and the
    busiest rank's share against imbalance();
  the forward + backward time, median of the repeats, the ways taking turns; the step is
    the slowest rank's. cp 1 also times SDPA on the whole sequence: the ratio's denominator.
The ranks share 2 cores here, so cp 4 is 4 processes on 2 cores, and ring steps are Python
loops over chunk pairs against SDPA's fused kernel: the CPU shows the counts and the
imbalance, not a GPU's speed-up. minidist/bench/cp_model.py predicts that, labelled.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist import comm
from minidist.bench import cp_model, rank_device
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import interleaved
from minidist.context_parallel import (ATTENTIONS, attention_bytes, attention_memory, count_work, imbalance,
                                       ring_work, split_sequence)
from minidist.cost_model import Hardware
from minidist.launch import launch
from minidist.memory import measure_peak, storages_now

FULL = dict(B=1, H=4, T=1536, D=32, cps=(1, 2, 4), repeats=3)
QUICK = dict(B=1, H=4, T=64, D=8, cps=(1, 2), repeats=1)
WAYS = {w if w == "ulysses" else f"{w} {l}": (w, l) for w, l in cp_model.WAYS}
TOL = 1e-5  # fp32: blockwise sums in another order than SDPA's


def _slices(parts, layout):
    """This rank's slices of the whole q, k, v, dout: fresh leaves for q, k, v."""
    ql, kl, vl, dl = (split_sequence(t, None, 2, layout) for t in parts)
    return [t.clone().requires_grad_() for t in (ql, kl, vl)], dl


def _rank(size: dict) -> dict:
    """On every rank: each way checked, counted, measured and timed; this rank's numbers."""
    dev, n = rank_device(), dist.get_world_size()
    B, H, T, D = (size[k] for k in "BHTD")
    g = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    whole = [torch.randn(B, H, T, D, generator=g).to(dev) for _ in range(4)]  # q, k, v, dout
    q, k, v = (t.clone().requires_grad_() for t in whole[:3])
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(whole[3])
    want = [o.detach(), q.grad, k.grad, v.grad]
    del q, k, v, o
    base = storages_now()  # one walk of Python's objects (each costs a fraction of a second)
    peaks = {}
    for name, (way, layout) in WAYS.items():
        (ql, kl, vl), dl = _slices(whole, layout)
        with measure_peak(base | {dl.untyped_storage().data_ptr()}) as mem:  # q, k, v counted
            o = ATTENTIONS[way](ql, kl, vl, None, causal=True, layout=layout)
        peaks[name] = mem.peak
        del o, ql, kl, vl, dl
    out, steps = {}, {}
    for name, (way, layout) in WAYS.items():
        attention = ATTENTIONS[way]
        (ql, kl, vl), dl = _slices(whole, layout)
        with comm.count_bytes() as fwd, count_work() as work:
            o = attention(ql, kl, vl, None, causal=True, layout=layout)
        with comm.count_bytes() as bwd:
            o.backward(dl)
        got = (o.detach(), ql.grad, kl.grad, vl.grad)
        err = max((a - split_sequence(w, None, 2, layout)).abs().max().item() for a, w in zip(got, want))
        out[name] = dict(err=err, sent_forward=sum(fwd.values()), sent_backward=sum(bwd.values()),
                         work=sum(work.values()), peak=peaks[name])

        def step(attention=attention, layout=layout, parts=(ql, kl, vl, dl)):
            leaves = [t.detach().requires_grad_() for t in parts[:3]]
            attention(*leaves, None, causal=True, layout=layout).backward(parts[3])
        steps[name] = step
    if n == 1:  # the oracle, timed in the same turns
        leaves = [t.clone().requires_grad_() for t in whole[:3]]
        steps["sdpa"] = lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(whole[3])
    times = interleaved(steps, size["repeats"], before=lambda _: dist.barrier())
    for name, m in times.items():
        out.setdefault(name, {})["step_s"] = m.median
    return out


def _rows(size: dict, n: int, ranks: list, sdpa_s: float, hw: Hardware) -> list[dict]:
    """One row per way at cp n: every rank's numbers beside the formulas."""
    B, H, T, D = (size[k] for k in "BHTD")
    rows = []
    for name, (way, layout) in WAYS.items():
        per = [r[name] for r in ranks]
        sent = attention_bytes(way, B, H, T, D, n)
        memory = attention_memory(way, B, H, T, D, n, layout=layout)
        row = dict(cp=n, way=name, max_err=max(p["err"] for p in per),
                   step_s=max(p["step_s"] for p in per), vs_sdpa=max(p["step_s"] for p in per) / sdpa_s,
                   sent_forward=[p["sent_forward"] for p in per], sent_backward=[p["sent_backward"] for p in per],
                   sent_formula=sent, peak=[p["peak"] for p in per], memory_formula=sum(memory.values()),
                   memory_parts=memory)
        row["sent_equal_formula"] = all(f == sent["forward"] and b == sent["backward"]
                                        for f, b in zip(row["sent_forward"], row["sent_backward"]))
        row["peak_vs_formula"] = max(row["peak"]) / row["memory_formula"]
        if way == "ring":
            row["work"] = [p["work"] for p in per]
            row["work_formula"] = [ring_work(T, n, r, layout) for r in range(n)]
            row["imbalance"] = max(row["work"]) / (sum(row["work"]) / n)
            row["imbalance_formula"] = imbalance(T, n, layout)
        row["predicted_vs_one_gpu"] = cp_model.vs_one_gpu(way, layout, n, hw)
        rows.append(row)
    return rows


def run(args) -> dict:
    size = QUICK if args.quick else FULL
    B, H, T, D = (size[k] for k in "BHTD")
    hw = Hardware()
    result = dict(size=size, tolerance=TOL, cores=os.cpu_count(), hardware=hw.name, rows=[])
    print(f"causal attention, B {B} x H {H} x T {T} x D {D}, fp32; forward + backward, median of "
          f"{size['repeats']}, slowest rank; {os.cpu_count()} CPU cores; outputs and gradients within "
          f"{TOL:g} of SDPA on the whole sequence, or flagged")
    sdpa_s = None
    for n in size["cps"]:
        t0 = time.perf_counter()
        ranks = launch(_rank, n, size, timeout_s=900, device="auto")
        if n == 1:
            sdpa_s = ranks[0]["sdpa"]["step_s"]
            print(f"SDPA on the whole sequence, one process: {1e3 * sdpa_s:.1f} ms (the ratios' denominator)")
        rows = _rows(size, n, ranks, sdpa_s, hw)
        result["rows"] += rows
        print(f"\ncp {n} ({n} process{'es' if n > 1 else ''} on {os.cpu_count()} cores), "
              f"{time.perf_counter() - t0:.0f} s")
        print(f"  {'way':16} {'max err':>8} {'step ms':>8} {'/ SDPA':>7} {'GPU pred.':>9} | {'sent KB/rank':>12} "
              f"{'= formula':>9} | {'peak MB':>8} {'formula':>8} {'ratio':>6} | work per rank (formula), imbalance")
        for r in rows:
            ok = "yes" if r["sent_equal_formula"] else "NO"
            pred = "-" if r["predicted_vs_one_gpu"] is None else f"{r['predicted_vs_one_gpu']:.2f}"
            err = f"{r['max_err']:.1e}" + ("" if r["max_err"] <= TOL else " !")
            line = (f"  {r['way']:16} {err:>8} {1e3 * r['step_s']:8.1f} {r['vs_sdpa']:7.2f} {pred:>9} | "
                    f"{(r['sent_forward'][0] + r['sent_backward'][0]) / 1e3:12.1f} {ok:>9} | "
                    f"{max(r['peak']) / 1e6:8.2f} {r['memory_formula'] / 1e6:8.2f} {r['peak_vs_formula']:6.2f} |")
            if "work" in r:
                same = "=" if r["work"] == r["work_formula"] else "!="
                line += (f" {'/'.join(map(str, r['work']))} ({same}), {r['imbalance']:.2f} "
                         f"({r['imbalance_formula']:.2f})")
            print(line)
    result["all_within_tolerance"] = all(r["max_err"] <= TOL for r in result["rows"])
    result["sent_equal_formulas"] = all(r["sent_equal_formula"] for r in result["rows"])
    result["work_equal_formulas"] = all(r["work"] == r["work_formula"] for r in result["rows"] if "work" in r)
    print(f"\nevery way and cp: outputs and gradients within {TOL:g} of SDPA: {result['all_within_tolerance']}; "
          f"bytes sent == attention_bytes: {result['sent_equal_formulas']}; ring work == ring_work: "
          f"{result['work_equal_formulas']}")
    print("(step / SDPA: measured here against SDPA on the whole sequence on one process; GPU pred.: "
          f"PREDICTED by cp_model for a {cp_model.AT_SCALE['H']}-head x {cp_model.AT_SCALE['D']} layer, "
          f"T {cp_model.BESIDE_T}, bf16, on cp GPUs of one node, against one GPU's flash SDPA (1/cp is perfect); "
          "peak: live tensor bytes at the forward's peak, this rank's q, k, v included, against "
          "attention_memory's K, V and one score matrix)")
    result["at_scale"] = _print_at_scale(hw)
    _plot(result, Path(args.out) / "cp.png")
    return result


def _print_at_scale(hw: Hardware) -> list[dict]:
    s = cp_model.AT_SCALE
    rows = cp_model.at_scale(hw)
    keys = [k[:-3] for k in rows[0] if k.endswith("_ms") and k != "one_gpu_ms"]
    print(f"\nPREDICTED, not measured: one attention layer (H {s['H']} x D {s['D']}, bf16, one sequence), "
          f"forward + backward, busiest GPU, ms; K, V held per GPU in GB; {hw.name}")
    print(f"  {'GPUs':>4} {'T':>7} {'1 GPU':>8} | " + " | ".join(f"{k:>15}" for k in keys) + " | fastest")
    for r in rows:
        cells = ["cannot (heads)".rjust(15) if r[f"{k}_ms"] is None else
                 f"{r[f'{k}_ms']:8.1f} {r[f'{k}_kv_GB']:6.2f}" for k in keys]
        print(f"  {r['n']:4d} {r['T']:7d} {r['one_gpu_ms']:8.1f} | " + " | ".join(cells) + f" | {r['fastest']}")
    return rows


def _plot(result, path) -> None:
    plt = pyplot()
    rows, cps = result["rows"], result["size"]["cps"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    width = 0.8 / len(WAYS)
    for i, name in enumerate(WAYS):
        mine = [r for r in rows if r["way"] == name]
        xs = [c + (i - (len(WAYS) - 1) / 2) * width for c in range(len(mine))]
        axes[0].bar(xs, [r["vs_sdpa"] for r in mine], width, color=f"C{i}", label=f"{name}, measured")
        axes[0].scatter(xs, [r["predicted_vs_one_gpu"] or 0 for r in mine], marker="_", s=200, color="black",
                        label=f"predicted, GPU node (T {cp_model.BESIDE_T})" if i == 0 else None, zorder=3)
        axes[1].bar(xs, [max(r["peak"]) / 1e6 for r in mine], width, color=f"C{i}", label=name)
        axes[1].scatter(xs, [r["memory_formula"] / 1e6 for r in mine], marker="_", s=200, color="black",
                        label="attention_memory" if i == 0 else None, zorder=3)
    for ax, label, title in ((axes[0], "step time / SDPA on one process", "forward + backward, slowest rank"),
                             (axes[1], "forward peak per rank, MB", "memory, busiest rank")):
        ax.set_xticks(range(len(cps)), [f"cp {c}" for c in cps])
        ax.set(ylabel=label, title=title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    for color, layout in (("C0", "contiguous"), ("C1", "zigzag")):
        for r in (r for r in rows if r["way"] == f"ring {layout}" and r["cp"] > 1):
            axes[2].plot(range(r["cp"]), r["work"], marker="os^"[cps.index(r["cp"]) % 3], color=color,
                         label=f"{layout}, cp {r['cp']} (counted)")
            axes[2].plot(range(r["cp"]), r["work_formula"], ls=":", color="black")
    axes[2].set_xticks(range(max(cps)))
    axes[2].set(xlabel="rank", ylabel="score entries (dotted: ring_work)", title="causal ring work per rank")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"Context parallelism, T = {result['size']['T']}: measured on {result['cores']} CPU cores; "
                 "GPU figures predicted by the cost model", fontsize=10)
    save_figure(fig, path)
