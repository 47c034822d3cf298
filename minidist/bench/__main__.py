"""`python -m minidist.bench NAME`: one benchmark, or `all` of them with one report.
Chapter 08 (chapters/08_at_scale.md). Exercised by `python -m minidist.bench scale --quick`
(tests/test_cost_model.py, which also runs `all` with stub benchmarks) and by
tests/test_bench.py.

Each benchmark (collectives 02, ddp 03, zero 06, muon and muon_zero 07, checksums and scale
08, tp 10, pp 11; each module's docstring says what it measures) compares minidist with
torch's own implementation in the same run, as ratios: absolute times do not travel between
machines, ratios measured side by side do. It prints a table and writes NAME.json and
NAME.png into --out; `all` runs every one, then report.md (minidist/bench/report.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from minidist.run.flag_types import positive_int
from minidist.bench import checksums, collectives, ddp, muon, muon_zero, pp, report, scale, tp, zero


BENCHMARKS = {"collectives": collectives.run, "ddp": ddp.run, "zero": zero.run, "muon": muon.run,
              "muon_zero": muon_zero.cli, "scale": scale.run, "checksums": checksums.run, "tp": tp.run,
              "pp": pp.run, "all": lambda args: report.run_all(args, BENCHMARKS)}


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
