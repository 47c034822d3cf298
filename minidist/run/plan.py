"""The planners' command line: what fits a memory budget, and what it costs. Chapter 09
(chapters/09_memory.md) for `memory`, chapter 11 (chapters/11_pipeline.md) for `mesh`:

    python -m minidist.run.plan memory --preset gpt2 --world-size 8 --budget-gb 80
    python -m minidist.run.plan memory --preset tiny --seq-len 128 --measure-recompute 16
    python -m minidist.run.plan mesh --preset gpt3-6.7b --world-size 16 --budget-gb 80
    pytest tests/test_plan.py tests/test_plan_mesh.py

The planners themselves (minidist.memory.plan, minidist.compose.plan_mesh) take sizes and
return their choice; this module only reads flags and prints.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch

from minidist.compose import plan_mesh as PM
from minidist.cost_model import GB, MODELS, Hardware
from minidist.memory import plan as P
from minidist.memory import step_memory
from minidist.model import PRESETS, GPTConfig, config_num_params
from minidist.run.flag_types import positive_float, positive_int

CONFIGS = {**{k: GPTConfig(**v) for k, v in PRESETS.items()}, **MODELS}
MAX_COUNT = P.MAX_COUNT  # ranks, tokens or sequences: the planners refuse more (their searches stay short)


def _memory_here() -> float:
    """Bytes free where --measure-recompute runs: the GPU's, or the machine's available memory."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf")  # unknown: let it try


def memory_table(cfg, batch, seq_len, world, budget_gb, precision) -> list[str]:
    """Every configuration of chapter 09's planner for one model, world size and budget, cheapest first."""
    rows = [P.evaluate(cfg, batch, seq_len, world, s, k, ck, precision)
            for s in (0, 1, 2, 3) for ck in (False, True) for k in P.accum_options(batch, world)]
    rows.sort(key=P.Choice.price)
    return [f"  {'fits' if c.peak <= budget_gb * GB else '    '}  {c.describe():55s} {c.peak / GB:8.2f} GB  "
            f"{c.comm_bytes / GB:7.2f} GB sent" for c in rows]


def mesh_table(cfg, batch, seq_len, world, budget_gb, precision="bf16", hw=None) -> list[str]:
    """The best plan of each mesh shape, fastest first; shapes where nothing fits last."""
    best = {}  # by mesh: dp x tp x pp, or dp x cp (chapter 12)
    for _, c in PM.best_per_family(cfg, batch, seq_len, world, budget_gb, precision, hw):
        if c is not None and (c.mesh() not in best or c.price() < best[c.mesh()].price()):
            best[c.mesh()] = c
    rows = [f"  {'mesh':22s} {'ZeRO':>4s} {'m':>4s} {'B':>4s} {'sp':>3s} {'rc':>3s} {'GB/rank':>8s} "
            f"{'bubble':>6s} {'GB sent':>8s} {'ms/step':>8s}"]
    for c in sorted(best.values(), key=PM.Plan.price):
        yes = ["yes" if on else "no" for on in (c.sequence_parallel, c.checkpointed)]
        rows.append(f"  {c.mesh():22s} {c.zero:4d} {c.micro:4d} {c.micro_batch:4d} {yes[0]:>3s} {yes[1]:>3s} "
                    f"{c.peak / GB:8.1f} {c.bubble:6.2f} {(sum(c.sent) + c.cp_sent) / GB:8.2f} {1e3 * c.step_s:8.1f}")
    for shape in [f"dp {dp} x tp {tp} x pp {pp}" for dp, tp, pp in PM.meshes(cfg, world)] + \
            [f"dp {world // cp} x cp {cp}" for cp in PM.cp_sizes(world, seq_len)]:
        if shape not in best:
            rows.append(f"  {shape:22s} nothing fits {budget_gb:g} GB")
    return rows


def memory(a, p) -> None:
    """Chapter 09: one axis (ZeRO stage, micro-steps, recomputation), or --measure-recompute."""
    batch = a.batch_size or 8 * a.world_size
    try:
        P.check_sizes(batch, a.seq_len, a.world_size, a.budget_gb)
    except P.PlanError as e:
        p.error(f"--batch-size/--world-size: {e}")
    cfg = CONFIGS[a.preset]
    if a.vocab_size:
        cfg = replace(cfg, vocab_size=a.vocab_size)
    if a.measure_recompute:
        cfg = replace(cfg, block_size=max(cfg.block_size, a.seq_len))
        need = step_memory(cfg, a.measure_recompute, a.seq_len, 1, 0, False, "fp32")["peak"]  # (Adam's too: a margin)
        have = _memory_here()
        if need > 0.8 * have:
            p.error(f"--measure-recompute builds {a.preset} here in fp32 with a batch of {a.measure_recompute}: about "
                    f"{need / GB:.1f} GB, and this machine has {have / GB:.1f} GB free: use a smaller --preset or B")
        plain, ckpt = P.measure_recompute(cfg, a.measure_recompute, a.seq_len)
        print(f"{a.preset}, {a.measure_recompute} x {a.seq_len}: forward + backward {plain * 1e3:.0f} ms, with "
              f"recomputation {ckpt * 1e3:.0f} ms: +{100 * (ckpt / plain - 1):.0f}% "
              f"(the blocks' forward FLOPs: +{100 * P.recompute_flops_fraction(cfg, a.seq_len):.0f}%)")
        return
    print(f"{a.preset}: {config_num_params(cfg) / 1e6:.0f}M parameters, {a.world_size} ranks, batch "
          f"{batch} x {a.seq_len}, {a.precision}, budget {a.budget_gb:g} GB per rank")
    try:
        print("  plan: " + P.plan(cfg, batch, a.seq_len, a.world_size, a.budget_gb, a.precision)[1])
    except P.PlanError as e:
        print(f"  plan: {e}")
    if len(P.accum_options(batch, a.world_size)) <= 8:
        print("\n".join(memory_table(cfg, batch, a.seq_len, a.world_size, a.budget_gb, a.precision)))
    print(f"\nevery model, 8 sequences of {a.seq_len} per rank per step, {a.budget_gb:g} GB per rank:")
    for name, c in MODELS.items():
        for n in (1, 8, 64, 1024):
            try:
                line = P.plan(c, 8 * n, a.seq_len, n, a.budget_gb, a.precision)[1].split(";")[0]
            except P.PlanError as e:
                line = str(e).split(";")[0]
            print(f"  {name:>5s} x {n:4d}: {line}")


def mesh(a, p) -> None:
    """Chapter 11: dp x tp x pp, ZeRO, micro-batches and recomputation."""
    for flag, v in (("--world-size", a.world_size), ("--seq-len", a.seq_len), ("--gpus-per-node", a.gpus_per_node),
                    ("--batch-size", a.batch_size)):
        if v is not None and not 1 <= v <= MAX_COUNT:
            p.error(f"argument {flag}: must be an integer from 1 to {MAX_COUNT:,}, got {v}: a count a machine could have")
    if not (math.isfinite(a.budget_gb) and a.budget_gb > 0):
        p.error(f"argument --budget-gb: must be a finite number > 0, got {a.budget_gb}: give the GB each rank may use")
    cfg, batch = CONFIGS[a.preset], a.batch_size or 8 * a.world_size
    cfg = replace(cfg, block_size=max(cfg.block_size, a.seq_len))
    try:
        P.check_sizes(batch, a.seq_len, a.world_size, a.budget_gb)
    except P.PlanError as e:
        p.error(f"--batch-size/--world-size: {e}")
    hw = Hardware(gpus_per_node=a.gpus_per_node)
    print(f"{a.preset}: {config_num_params(cfg) / 1e6:.0f}M parameters, {cfg.n_layer} layers, {cfg.n_head} heads; "
          f"{a.world_size} ranks, {a.gpus_per_node} per node; batch {batch} x {a.seq_len}, {a.precision}; "
          f"budget {a.budget_gb:g} GB per rank")
    try:
        print("  plan: " + PM.plan_mesh(cfg, batch, a.seq_len, a.world_size, a.budget_gb, a.precision, hw)[1])
    except P.PlanError as e:
        print(f"  plan: {e}")
    print("the best plan of each mesh shape (m micro-batches of B sequences, sp: sequence parallel, "
          "rc: recomputation; GB/rank: the most loaded rank's peak; GB sent: the busiest rank's, per step):")
    print("\n".join(mesh_table(cfg, batch, a.seq_len, a.world_size, a.budget_gb, a.precision, hw)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minidist.run.plan", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="planner", required=True)
    parsers = {"memory": sub.add_parser("memory", help="chapter 09: ZeRO stage, micro-steps, recomputation"),
               "mesh": sub.add_parser("mesh", help="chapter 11: dp x tp x pp as well")}
    for name, q in parsers.items():  # chapter 09's checks each number as argparse reads it
        count, budget = (positive_int, positive_float) if name == "memory" else (int, float)
        q.add_argument("--preset", default="gpt2", help=f"one of {', '.join(CONFIGS)}")
        q.add_argument("--world-size", type=count, default=8)
        q.add_argument("--budget-gb", type=budget, default=80.0, help="per rank")
        q.add_argument("--batch-size", type=count, default=None, help="global, in sequences (default 8 per rank)")
        q.add_argument("--seq-len", type=count, default=1024)
        q.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    parsers["memory"].add_argument("--measure-recompute", type=positive_int, metavar="B",
                                   help="time a step of B sequences with and without recomputation here, and stop")
    parsers["memory"].add_argument("--vocab-size", type=positive_int, help="default: the preset's (GPT-2's 50257)")
    parsers["mesh"].add_argument("--gpus-per-node", type=int, default=8, help="ranks joined by the fast links")
    a = p.parse_args(argv)
    q = parsers[a.planner]
    if a.preset not in CONFIGS:
        q.error(f"argument --preset: unknown model {a.preset!r}: one of {', '.join(CONFIGS)}")
    (memory if a.planner == "memory" else mesh)(a, q)


if __name__ == "__main__":
    main()
