"""`python -m minidist.bench pp`: pipeline parallelism's bubble and in-flight memory, measured
on recorded timelines and counted, against their formulas. Chapter 11
(chapters/11_pipeline.md, which reads the table). Exercised by `python -m minidist.bench pp
--quick` (tests/test_bench.py).

At p = 2 and 4 stages (a process each), m = 1..16, GPipe, 1F1B, ZB-H1 and (where the blocks
make 2 chunks a stage, m in groups of p) interleaved 1F1B (the appendix, section G): the
bubble from the recorded timelines (bubble_fraction) beside the ideal timeline's
(schedule_bubble: (p-1)/(m+p-1) for the first two); the micro-batches and bytes in flight,
counted, against the formulas (exact: equal or not); and torch.distributed.pipelining's GPipe
and 1F1B on the same stages (the same gradients, step time). The model is sized so compute
dominates the messages. With fewer cores than stages the idle is not idle hardware (a waiting
stage's core runs another's work): the "on core" column says how much each stage had, and a
point whose stages had a core for 0.1 less of the step than they could (1 - bubble, at most
cores / p) is flagged "shared": another job held a core then.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minidist.bench import rank_device
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import interleaved
from minidist.launch import launch
from minidist.model import GPT, GPTConfig
from minidist.pipeline import Stage, chunk_layers, pipeline_step, run_schedule, split_layers, stage_for
from minidist.pipeline.measure import (StepRecord, bubble_fraction, in_flight, in_flight_formula,
                                       schedule_bubble, stage_activation_bytes)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
V = 2  # interleaved 1F1B's chunks per stage
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": f"interleaved (v {V})", "zb-h1": "ZB-H1"}
FULL = dict(cfg=dict(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=256), batch=8,
            ps=(2, 4), ms=tuple(range(1, 17)), repeats=3, torch_ms=(4, 8), torch_rounds=5)
QUICK = dict(cfg=dict(n_layer=4, n_head=2, n_embd=64, block_size=32, vocab_size=128), batch=2,
             ps=(2,), ms=(1, 2, 4), repeats=1, torch_ms=(2,), torch_rounds=1)


def micro_counts(sched: str, p: int, ms, n_layer: int) -> list:
    """The m a schedule runs at: interleaved's in groups of p, with V chunks of a block or more."""
    if sched != "interleaved":
        return list(ms)
    return [m for m in ms if m % p == 0] if n_layer >= p * V else []


def _micro_batches(cfg: dict, B: int, n: int, seed: int, dev) -> list:
    """n (input, target) pairs of B sequences: one tensor each (the byte count dedups by
    storage, so no views of one batch)."""
    g, size = torch.Generator().manual_seed(seed), (B, cfg["block_size"])
    return [tuple(torch.randint(0, cfg["vocab_size"], size, generator=g).to(dev) for _ in "xy") for _ in range(n)]


def _sweep(cfg: dict, B: int, ms, repeats: int) -> dict | None:
    """On every stage: each (schedule, m) run once counting the saved bytes, then `repeats`
    timed times without (the count's hooks slow a split backward: StepRecord); rank 0 gets
    every stage's records and CPU seconds, the counted step first."""
    dev, p = rank_device(), dist.get_world_size()
    torch.manual_seed(0)  # the same full model on every stage, cut there
    full = GPT(GPTConfig(**cfg)).to(dev)
    todo = {sched: micro_counts(sched, p, ms, cfg["n_layer"]) for sched in SCHEDULES}
    stages = {sched: stage_for(sched, full, None, V) for sched in SCHEDULES if todo[sched]}
    mbs = _micro_batches(cfg, B, max(ms), 1, dev)
    for sched, stage in stages.items():  # warm-up: allocator, gloo's pairs, the first-call overheads
        run_schedule(stage, mbs[:todo[sched][0]], sched)
    out = {}
    for sched, stage in stages.items():
        for m in todo[sched]:
            runs = []
            for i in range(repeats + 1):
                stage.zero_grad(set_to_none=True)
                rec = StepRecord(count_saved=i == 0)
                cpu = time.process_time()
                run_schedule(stage, mbs[:m], sched, record=rec)
                cpu = time.process_time() - cpu
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                every = [None] * p
                dist.all_gather_object(every, (rec, cpu))
                runs.append(every)
            out[sched, m] = runs
    return out if dist.get_rank() == 0 else None


class TorchStageModule(nn.Module):
    """A minidist Stage as torch.distributed.pipelining wants a stage's module: forward(x)
    only, the last stage returning the logits for the schedule's loss_fn."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        s = self.stage
        x = s.embed(x) if s.is_first else x
        for block in s.blocks.values():
            x = block(x)
        return s.head(x)[0] if s.is_last else x


def _versus_torch(cfg: dict, B: int, ms, rounds: int) -> list | None:
    """On every stage: per schedule and m, the largest gradient difference after one step of
    ours and one of torch's from the same weights, then both timed in turns; rank 0 gets
    every stage's (difference, our median s, torch's median s)."""
    # imported here, on the ranks that compare: it takes seconds, and nothing else needs it
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    dev, p, rank = rank_device(), dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = GPT(GPTConfig(**cfg)).to(dev)
    ours, theirs = Stage(full, None), Stage(full, None)  # two copies of the same weights
    mbs = _micro_batches(cfg, B, max(ms), 2, dev)
    rows = []
    for sched in ("gpipe", "1f1b"):
        for m in ms:
            x, y = torch.cat([a for a, _ in mbs[:m]]), torch.cat([b for _, b in mbs[:m]])
            count = float((y != -1).sum())  # normalised as pipeline_step normalises its loss

            def loss_fn(logits, target):
                return F.cross_entropy(logits.float().flatten(0, 1), target.reshape(-1), ignore_index=-1,
                                       reduction="sum") / count
            kind = ScheduleGPipe if sched == "gpipe" else Schedule1F1B
            schedule = kind(PipelineStage(TorchStageModule(theirs), rank, p, dev), m, loss_fn=loss_fn,
                            scale_grads=False)

            def mine():
                ours.zero_grad(set_to_none=True)
                pipeline_step(ours, mbs[:m], sched)

            def torchs():
                theirs.zero_grad(set_to_none=True)
                schedule.step(*([x] if theirs.is_first else []), **({"target": y} if theirs.is_last else {}))
                theirs.allreduce_tied_grads()  # (not the schedule's: the same swap as ours)
            mine(), torchs()
            diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
            t = interleaved({"ours": mine, "torch": torchs}, rounds, before=lambda _: dist.barrier())
            every = [None] * p
            dist.all_gather_object(every, (diff, t["ours"].median, t["torch"].median))
            rows.append(dict(p=p, schedule=sched, m=m, max_grad_diff=max(e[0] for e in every),
                             ours_s=max(e[1] for e in every), torch_s=max(e[2] for e in every)))
    return rows if rank == 0 else None


def _held_peak(actions, per: dict) -> int:
    """The most of per[chunk] bytes held at once over a stage's actions, a forward's held
    until its W where the backward is split, else its B: the walk, with the formula's bytes."""
    split = any(kind == "W" for kind, _, _ in actions)
    held, most = set(), 0
    for kind, c, mb in actions:
        if kind == "F":
            held.add((c, mb))
        elif kind == ("W" if split else "B"):
            held.remove((c, mb))
        most = max(most, sum(per[c] for c, _ in held))
    return most


def _point(cfg: GPTConfig, B: int, p: int, m: int, sched: str, runs, cores: int) -> dict:
    """One (p, m, schedule): the bubble, measured (median over the runs) and on the ideal
    timeline, whether another job held a core, and per stage the counted in-flight peaks and
    saved bytes beside the formulas (per chunk, for interleaved)."""
    bubbles, cpu_share, spans = [], [], []
    for every in runs[1:]:  # the timed steps (the first counted the saved bytes)
        records = [r for r, _ in every]
        spans.append(max(e.end for r in records for e in r.events))
        bubbles.append(bubble_fraction(records))
        cpu_share.append(sum(c for _, c in every) / (p * spans[-1]))
    records = [r for r, _ in runs[0]]
    v = V if sched == "interleaved" else 1
    cuts = chunk_layers(cfg.n_layer, p, v) if v > 1 else split_layers(cfg.n_layer, p)
    stages = []
    for s, r in enumerate(records):
        per = {c: stage_activation_bytes(cfg, B, cfg.block_size, len(cuts[c * p + s]), c * p + s == 0,
                                         c * p + s == p * v - 1) for c in range(v)}
        k, acts = in_flight_formula(sched, p, s, m, v), r.actions()
        stages.append(dict(stage=s, peak_in_flight=r.peak_in_flight, in_flight_order=in_flight(acts),
                           in_flight_formula=k, saved_per_mb=r.saved_bytes,
                           saved_per_mb_formula=[per[c] for kind, c, _ in acts if kind == "F"],
                           peak_saved=r.peak_saved, peak_saved_formula=_held_peak(acts, per)))
    formula, measured, on_core = schedule_bubble(sched, p, m, v), statistics.median(bubbles), statistics.median(cpu_share)
    return dict(p=p, m=m, schedule=sched, bubble=measured, bubbles=bubbles, formula=formula,
                ratio=measured / formula if formula else None, cpu_share=on_core,
                shared=on_core < min(1 - measured, cores / p) - 0.1,
                step_s=statistics.median(spans), stages=stages)


def run(args) -> dict:
    size = QUICK if args.quick else FULL
    cfg, B = size["cfg"], size["batch"]
    gcfg = GPTConfig(**cfg)
    result = dict(config=cfg, batch=B, cores=os.cpu_count(), points=[])
    print(f"GPT of {gcfg.n_layer} blocks, d={gcfg.n_embd}, vocab {gcfg.vocab_size}; micro-batches of "
          f"{B} x {gcfg.block_size} tokens, fp32; {size['repeats']} step(s) per point, median; "
          f"{os.cpu_count()} CPU cores")
    for p in size["ps"]:
        t0 = time.perf_counter()
        runs = launch(_sweep, p, cfg, B, size["ms"], size["repeats"], timeout_s=1800, device="auto")[0]
        points = [_point(gcfg, B, p, m, s, runs[s, m], os.cpu_count()) for s, m in runs]
        result["points"] += points
        print(f"\np = {p} stages ({p} processes on {os.cpu_count()} cores), "
              f"{time.perf_counter() - t0:.0f} s; the ideal timeline's bubble beside the measured one")
        print(f"  {'schedule':>17} {'m':>3} {'ideal':>6} {'measured':>8} {'/ideal':>6} {'step s':>7} {'/1F1B':>6} "
              f"{'on core':>7}")
        step_1f1b = {pt["m"]: pt["step_s"] for pt in points if pt["schedule"] == "1f1b"}
        for pt in points:
            print(f"  {NAMES[pt['schedule']]:>17} {pt['m']:3d} {pt['formula']:6.3f} {pt['bubble']:8.3f} "
                  f"{pt['ratio']:6.2f} {pt['step_s']:7.2f} {pt['step_s'] / step_1f1b[pt['m']]:6.2f} "
                  f"{pt['cpu_share']:7.2f}" + ("  shared" if pt["shared"] else ""))
        print("  in flight at each schedule's largest m, per stage: peak (chunk,) micro-batches (formula), "
              "peak saved MB (formula)")
        for s in SCHEDULES:
            last = [pt for pt in points if pt["schedule"] == s][-1:]
            cells = [f"stage {st['stage']}: {st['peak_in_flight']} ({st['in_flight_formula']}), "
                     f"{st['peak_saved'] / 1e6:.1f} ({st['peak_saved_formula'] / 1e6:.1f})"
                     for pt in last for st in pt["stages"]]
            if cells:
                print(f"  {NAMES[s]:>17} m {last[0]['m']}: " + " | ".join(cells))
    exact = all(st["peak_in_flight"] == st["in_flight_formula"] == st["in_flight_order"]
                and st["peak_saved"] == st["peak_saved_formula"]
                and st["saved_per_mb"] == st["saved_per_mb_formula"]
                for pt in result["points"] for st in pt["stages"])
    result["memory_counts_equal_formulas"] = exact
    print(f"\nin-flight micro-batches and saved bytes, every stage, schedule and m: counted "
          f"{'==' if exact else '!='} formula")
    print("(bubble: 1 - forward, backward and W time / (p x step time), from the recorded timelines of steps "
          "that did not count saved bytes; /1F1B: the step's time over 1F1B's at the same m; on core: the "
          "stages' process CPU seconds / (p x step time), at most cores / p; shared: on core 0.1 below "
          "1 - bubble (or cores / p), another job held a core)")
    result["versus_torch"] = []
    print("\nagainst torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on the same stages: "
          "max |gradient difference|, median step (slowest stage), torch / ours")
    for p in size["ps"]:
        rows = launch(_versus_torch, p, cfg, B, size["torch_ms"], size["torch_rounds"], timeout_s=1800, device="auto")[0]
        result["versus_torch"] += rows
        for r in rows:
            print(f"  p {p} {r['schedule']:>5} m {r['m']:2d}: gradients differ by {r['max_grad_diff']:.1e} | "
                  f"ours {1e3 * r['ours_s']:7.1f} ms, torch {1e3 * r['torch_s']:7.1f} ms, "
                  f"torch / ours {r['torch_s'] / r['ours_s']:.2f}")
    _plot(result, Path(args.out) / "pp.png")
    return result


def _plot(result, path) -> None:
    plt = pyplot()
    ps = sorted({pt["p"] for pt in result["points"]})
    fig, axes = plt.subplots(1, len(ps), figsize=(5.2 * len(ps), 3.8), squeeze=False, sharey=True)
    for ax, p in zip(axes[0], ps):
        pts = [pt for pt in result["points"] if pt["p"] == p]
        ms = sorted({pt["m"] for pt in pts})
        fine = [x / 10 for x in range(10, 10 * max(ms) + 1)]
        ran = [s for s in SCHEDULES if any(pt["schedule"] == s for pt in pts)]
        for s, style in (("1f1b", "-"), ("interleaved", "--"), ("zb-h1", ":")):  # GPipe's ideal is 1F1B's
            if s in ran:
                ax.plot(fine, [schedule_bubble(s, p, x, V if s == "interleaved" else 1) for x in fine], style,
                        color="black", lw=1, label="ideal, " + ("GPipe and 1F1B" if s == "1f1b" else NAMES[s]))
        for i, s in enumerate(ran):
            mine = sorted((pt for pt in pts if pt["schedule"] == s), key=lambda pt: pt["m"])
            xs = [pt["m"] + (i - 1.5) * 0.12 for pt in mine]
            lo = [pt["bubble"] - min(pt["bubbles"]) for pt in mine]
            hi = [max(pt["bubbles"]) - pt["bubble"] for pt in mine]
            ax.errorbar(xs, [pt["bubble"] for pt in mine], yerr=[lo, hi], fmt="o", ms=4, capsize=2,
                        color=f"C{i}", label=f"measured, {NAMES[s]}")
            shared = [(x, pt["bubble"]) for x, pt in zip(xs, mine) if pt["shared"]]
            if shared:  # a ring round a point taken while another job held a core
                ax.plot(*zip(*shared), "o", ms=9, mfc="none", color="red")
        ax.set(xlabel="micro-batches m", title=f"p = {p} stages, {p} processes on {result['cores']} cores",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("bubble: idle share of the step")
    fig.suptitle("Pipeline bubble, measured from the recorded timelines (median, range of the steps) "
                 "vs the ideal timeline's; red rings: taken while the cores were shared", fontsize=9)
    save_figure(fig, path)
