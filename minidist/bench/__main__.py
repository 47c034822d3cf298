"""`python -m minidist.bench NAME`: one benchmark, or `all` of them with one report.
Chapter 08 (chapters/08_at_scale.md). Exercised by `python -m minidist.bench scale --quick`
(tests/test_cost_model.py, which also runs `all` with stub benchmarks) and by
tests/test_bench.py.

Each benchmark compares minidist with torch's own implementation in the same run, as
ratios (absolute times do not travel between machines; ratios measured side by side do),
prints a table and writes NAME.json and NAME.png into --out:

    collectives  chapter 02: ring all-reduce, reduce-scatter, all-gather vs torch's; alpha-beta fit
    ddp          chapter 03: naive, flat, bucketed DDP vs torch's DDP, by bucket cap
    zero         chapter 06: ZeRO stages 0-3, memory vs the paper's formula, bytes, step time
    muon         chapter 07: Newton-Schulz vs torch's, distributed Muon, Muon vs AdamW, and
                 Muon under ZeRO stages 0-3 vs AdamW at the same stage
    muon_zero    that last table alone
    tp           chapter 10: tensor parallelism at tp 1, 2, 4: bytes, parameters, activations
                 against the formulas, step time beside a GPU node's predicted; our parallel
                 MLP vs torch's DTensor plans
    pp           chapter 11: the pipeline bubble measured from recorded timelines vs
                 (p-1)/(m+p-1) at p 2 and 4, m 1..16; in-flight activations counted vs
                 the formulas, GPipe and 1F1B; both against torch.distributed.pipelining's
                 schedules on the same stages (gradients, step time)
    scale        chapter 08: minidist.cost_model from 8 to 1024 GPUs (no processes)
    checksums    chapter 08: checkpoint save and load with and without their CRC-32s
    all          every one above, then report.md (minidist/bench/report.py); exit status 1
                 if any of them failed
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from minidist.run.flag_types import positive_int
from minidist.bench import checksums, collectives, ddp, muon, muon_zero, pp, report, scale, tp, zero


def all_benchmarks(args) -> dict:
    return report.run_all(args, BENCHMARKS)


BENCHMARKS = {"collectives": collectives.run, "ddp": ddp.run, "zero": zero.run, "muon": muon.run,
              "muon_zero": muon_zero.cli, "scale": scale.run, "checksums": checksums.run, "tp": tp.run,
              "pp": pp.run, "all": all_benchmarks}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minidist.bench", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("--out", default="bench_out", help="folder for NAME.json and NAME.png")
    p.add_argument("--quick", action="store_true", help="a few sizes, one world size (smoke test)")
    p.add_argument("--world-sizes", type=positive_int, nargs="+", default=[2, 4])
    p.add_argument("--ops", nargs="+", default=list(collectives.RING), choices=list(collectives.RING),
                   help="collectives to time (collectives only)")
    args = p.parse_args(argv)
    if args.name in ("muon_zero", "zero", "ddp", "tp", "pp", "collectives") and max(args.world_sizes) < 2:
        p.error(f"argument --world-sizes: {args.name} compares ranks: give at least one world size >= 2")
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"argument --out: cannot make the folder {args.out}: {e.strerror or e}: name a folder")
    result = BENCHMARKS[args.name](args)
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    png = Path(args.out) / f"{args.name}.png"
    print(f"wrote {args.out}/{args.name}.json" + (f" and {png}" if png.exists() else ""))


if __name__ == "__main__":
    main()
