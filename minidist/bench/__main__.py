"""`python -m minidist.bench NAME`: one benchmark, or `all` of them with one report.
Chapter 08 (chapters/08_at_scale.md). Exercised by `python -m minidist.bench scale --quick`
(tests/test_cost_model.py, which also runs `all` with stub benchmarks) and by
tests/test_bench.py.

Each benchmark (collectives 02, ddp 03, zero 06, muon and muon_zero 07, checksums and scale
08, tp 10, pp 11, cp 12, ep 13; each module's docstring says what it measures) compares minidist with
torch's own implementation in the same run, as ratios: absolute times do not travel between
machines, ratios measured side by side do. It prints a table and writes NAME.json and
NAME.png into --out; `all` runs every one, then report.md (minidist/bench/report.py).

Every option is checked before a benchmark starts (a benchmark takes minutes): one it would
ignore, a world size it cannot run, a file in --out it could not write, each exits 2 with one
line, rather than being lost or found after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from minidist.files import kind_of, read_bounded
from minidist.run.flag_types import number
from minidist.bench import (checksums, collectives, cp, cpu_default, ddp, ep, muon, muon_zero, pp, report, scale,
                            tp, zero)


BENCHMARKS = {"collectives": collectives.run, "ddp": ddp.run, "zero": zero.run, "muon": muon.run,
              "muon_zero": muon_zero.cli, "scale": scale.run, "checksums": checksums.run, "tp": tp.run,
              "pp": pp.run, "cp": cp.run, "ep": ep.run, "all": lambda args: report.run_all(args, BENCHMARKS)}
# what each benchmark makes of --world-sizes: the ranks it compares; the others pick their own
# (ddp: 2 ranks, pp: its stage counts, cp: cp 1, 2, 4, ep: ep 1, 2, 4) or start no processes
# (scale, checksums)
RANKS = ("collectives", "zero", "muon", "muon_zero", "tp", "all")
SPLIT_BATCH = ("zero", "tp", "all")  # they split cpu_default's batch over the ranks
# the files each writes into --out (a name ending in / is a folder)
WRITES = {name: (f"{name}.json", f"{name}.png") for name in BENCHMARKS}
WRITES.update(checksums=("checksums.json",), muon_zero=("muon_zero.json",),
              muon=("muon.json", "muon.png", "muon_runs/"))
WRITES["all"] = (*[f for name in report.ORDER for f in WRITES[name]], "report.md", "all.png", "all.json")
READS = ("collectives.json", "ddp.json", "zero.json")  # scale compares its model with these, where present
processes = number(int, 1, 64, what="an integer >= 1, at most 64 (processes on this machine)")


def check_options(p, args) -> None:
    """Exit 2 with one line for an option the benchmark would ignore or could not run."""
    name, given = args.name, args.world_sizes is not None
    for flag, values in (("--world-sizes", args.world_sizes or []), ("--ops", args.ops or [])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            p.error(f"argument {flag}: {', '.join(map(str, twice))} given twice: give each once")
    if args.ops is not None and name not in ("collectives", "all"):
        p.error(f"argument --ops: only collectives times --ops ({name} would ignore it): drop it")
    if given and name not in RANKS:
        why = {"ddp": "it runs 2 ranks", "pp": "it runs its own stage counts", "cp": "it runs its own cp sizes",
               "ep": "it runs its own ep sizes"}.get(name, "it starts no processes")
        p.error(f"argument --world-sizes: {name} would ignore it ({why}): drop it")
    if given and name == "collectives" and args.quick:
        p.error("argument --world-sizes: collectives --quick times 2 ranks only: drop --world-sizes, or --quick")
    args.world_sizes = args.world_sizes or [2, 4]
    args.ops = args.ops or list(collectives.RING)
    if name in RANKS and min(args.world_sizes) < 2:
        also = " with 1 rank (which it times anyway)" if name == "muon" else ""
        p.error(f"argument --world-sizes: {name} compares ranks{also}: give world sizes >= 2, "
                f"got {min(args.world_sizes)}")
    cfg, batch = cpu_default(args.quick)[:2]
    quick = " (--quick)" if args.quick else ""
    if name in SPLIT_BATCH and max(args.world_sizes) > batch:
        who = "zero and tp split" if name == "all" else f"{name} splits"
        p.error(f"argument --world-sizes: {who} a batch of {batch} sequences{quick} over the ranks: "
                f"give world sizes up to {batch}")
    mlp = 4 * cfg["n_embd"]  # tp also splits one MLP over every rank
    if name in ("tp", "all") and any(mlp % n for n in args.world_sizes):
        p.error(f"argument --world-sizes: tp splits an MLP of {mlp} columns{quick} over all the ranks: "
                f"give world sizes that divide {mlp}, got {', '.join(str(n) for n in args.world_sizes if mlp % n)}")


def output_problem(out: Path, names) -> str | None:
    """What stops a benchmark from writing `names` in folder `out` (made if missing), or
    None: the folder and each file tried now, not found after the benchmark has run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"argument --out: cannot make the folder {out}: {e.strerror or e}: name a folder"
    for path, folder in [(out, True)] + [(out / n.rstrip("/"), n.endswith("/")) for n in names]:
        try:
            if os.path.exists(path) and (os.path.isdir(path) != folder or not (folder or os.path.isfile(path))):
                # a folder where a file goes, a file where a folder goes, a FIFO that would block the write
                kind = "a file" if os.path.isfile(path) else kind_of(os.stat(path).st_mode)
                return (f"argument --out: {path} is {kind}, where the benchmark writes "
                        f"{'a folder' if folder else 'a file'}: move it away, or name another folder")
            if folder:
                path.mkdir(exist_ok=True)
                tempfile.TemporaryFile(dir=path).close()  # a write, really tried
            elif os.path.exists(path):
                open(path, "ab").close()  # opened for writing, nothing written
        except OSError as e:
            return f"argument --out: cannot write {path}: {e.strerror or e}: fix it, or name another folder"
    return None


def input_problem(out: Path) -> str | None:
    """What scale cannot read among the other benchmarks' results in `out`, or None."""
    for name in READS:
        if os.path.lexists(out / name):
            try:
                if not isinstance(json.loads(read_bounded(out / name, 2**26, "result file")), dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:  # (NotARegularFile and a JSON error are ValueErrors)
                return (f"argument --out: scale compares with {out / name}, which cannot be read ({e}): "
                        f"remove it, or run {name[:-5]} again")
    return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minidist.bench", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("--out", default="bench_out", help="folder for NAME.json and NAME.png")
    p.add_argument("--quick", action="store_true", help="a few sizes, one world size (smoke test)")
    p.add_argument("--world-sizes", type=processes, nargs="+",
                   help=f"ranks to compare ({', '.join(RANKS)}; default: 2 4)")
    p.add_argument("--ops", nargs="+", choices=list(collectives.RING),
                   help="collectives to time (collectives and all; default: all of them)")
    args = p.parse_args(argv)
    if not args.out.strip():
        p.error("argument --out: is empty: name a folder, e.g. --out bench_out")
    check_options(p, args)
    out = Path(args.out)
    problem = output_problem(out, WRITES[args.name]) or (input_problem(out) if args.name == "scale" else None)
    if problem:
        p.error(problem)
    result = BENCHMARKS[args.name](args)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    png = out / f"{args.name}.png"
    print(f"wrote {args.out}/{args.name}.json" + (f" and {png}" if png.exists() else ""))


if __name__ == "__main__":
    main()
