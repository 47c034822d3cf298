"""Grade the exercises: `python -m exercises.grade [NN ...] [--reference] [--hint [K]]`.

The report, the command line and the hints: `--hint` shows the next hint of the first
failing check (`--hint K` its K-th), counted in $XDG_CACHE_HOME/minidist/hints.json
(~/.cache/...; MINIDIST_HINT_STATE names another file). A finished grading exits 0
whatever the score; bad arguments exit 2.
"""

import argparse
import json
import os
import textwrap
from pathlib import Path

from exercises.grader.core import Result, available, checks_of, grade, hints_of


def report(results: list[Result], reference: bool) -> str:
    what = "minidist's reference implementations" if reference else "your implementations"
    lines = [f"Grading {what}", ""]
    for r in results:
        lines.append(f"{r.name}  ({r.seconds:.1f}s)")
        for c in r.checks:
            lines.append(f"  {'PASS' if c.ok else 'FAIL'}  {c.points}/{c.max_points}  {c.name}")
            # the whole hint or error, wrapped; only a runaway message (a tensor repr) is cut
            msg = textwrap.shorten(c.message, 600, placeholder=" ...") if c.message else ""
            lines += textwrap.wrap(msg, 88, initial_indent=" " * 8, subsequent_indent=" " * 8)
            if c.output.strip():  # the learner's prints, marked as theirs (never a report)
                shown = c.output.rstrip().splitlines()
                lines.append(" " * 8 + f"your code printed ({len(shown)} lines):")
                lines += [" " * 8 + "| " + ln[:100] for ln in shown[:8]]
                if len(shown) > 8:
                    lines.append(" " * 8 + "| ...")
        lines.append("")
    rows = [(r.name, f"{r.passed}/{r.total}", str(r.points), str(r.max_points)) for r in results]
    tot = [sum(getattr(r, a) for r in results) for a in ("passed", "total", "points", "max_points")]
    rows.append(("total", f"{tot[0]}/{tot[1]}", str(tot[2]), str(tot[3])))
    head = ("exercise", "tests passed", "points", "total")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(4)]
    for i, row in enumerate([head, *rows]):
        if i == len(rows):  # a rule above the total
            lines.append("-" * (sum(widths) + 6))
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `.chosen` holds the exercise numbers. Bad ones exit 2."""
    p = argparse.ArgumentParser(prog="python -m exercises.grade", description=__doc__.split("\n")[0])
    p.add_argument("exercises", nargs="*", metavar="NN", help="exercise numbers (default: all)")
    p.add_argument("--reference", action="store_true", help="grade minidist's implementations")
    p.add_argument("--hint", nargs="?", type=int, const=0, default=None, metavar="K",
                   help="after grading, the next hint for the first failing check (or hint K)")
    args = p.parse_args(argv)
    known = available()
    args.chosen = []
    for arg in args.exercises or list(known):
        nn = arg.split("_")[0].zfill(2)  # accept 1, 01 and 01_gpt
        if nn not in known:
            p.error(f"unknown exercise {arg!r}; available: "
                    + ", ".join(f"{k} ({v})" for k, v in known.items()))
        args.chosen.append(nn)
    args.chosen = list(dict.fromkeys(args.chosen))
    if args.hint is not None and len(args.chosen) != 1:
        p.error("--hint needs one exercise number, e.g. python -m exercises.grade 02 --hint")
    if args.hint is not None and args.hint < 0:
        p.error("--hint K counts from 1")
    return args


def hint_state_path() -> Path:
    if os.environ.get("MINIDIST_HINT_STATE"):
        return Path(os.environ["MINIDIST_HINT_STATE"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "minidist" / "hints.json"


def _load_state() -> tuple[dict, str]:
    """(the hint counts, a message when the file was unreadable or damaged and is reset)."""
    path = hint_state_path()
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not all(isinstance(k, str) and type(v) is int for k, v in state.items()):
            raise ValueError("not a table of counts")
        return state, ""
    except FileNotFoundError:  # none yet
        return {}, ""
    except (OSError, ValueError) as e:  # a folder, no permission, not text, not JSON, not a table of counts
        return {}, (f"(the hint state {path} ({type(e).__name__}) was unreadable or damaged and is reset; "
                    "counting hints from 1 again)")


def hint(result: Result, k: int | None = None) -> str:
    """The next hint (or the K-th, 1-based) for the first failing check of `result`,
    counted in the hint state file."""
    failing = next((c for c in result.checks if not c.ok), None)
    if failing is None:
        return f"{result.name}: every check passes; no hint needed."
    check_ = next(c for c in checks_of(result.nn) if c.name == failing.name)
    hints = hints_of(result.nn, check_)
    if not hints:
        return (f"{result.name}: no hints for '{failing.name}'; its message above says "
                "what is wrong, and the exercise's docstring states the rule it checks.")
    (state, note), key = _load_state(), f"{result.nn}:{failing.name}"
    shown = state.get(key, 0)
    if k is None:
        k = min(shown + 1, len(hints))
    if not 1 <= k <= len(hints):
        return f"{result.name}: '{failing.name}' has hints 1 to {len(hints)}, not {k}."
    state[key] = max(shown, k)
    try:
        path = hint_state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state, indent=1, sort_keys=True))
    except (OSError, ValueError):  # a read-only home: the hint still shows, the count does not advance
        pass
    more = ("this is the last one: the hints stop short of the answer; minidist's, named in "
            f"the file's REFERENCE, is graded by `python -m exercises.grade {result.nn} --reference`"
            if k == len(hints) else
            f"`python -m exercises.grade {result.nn} --hint` shows hint {k + 1}")
    return "\n".join(([note, ""] if note else [])
                     + [f"Hint {k} of {len(hints)} for {result.name}, '{failing.name}' ({more}):", ""]
                     + textwrap.wrap(hints[k - 1], 88, initial_indent="  ", subsequent_indent="  "))


def main(argv: list[str] | None = None) -> int:
    """Grade, then print the report: 0 once grading finished (whatever the score and
    whatever the learner's code did: it ran in other processes), 2 for bad arguments."""
    args = parse_args(argv)
    results = [grade(nn, args.reference) for nn in args.chosen]
    print(report(results, args.reference))
    if args.hint is not None:
        print()
        try:
            print(hint(results[0], None if args.hint == 0 else args.hint))
        except Exception as e:  # the report above stands; the hint machinery failed
            print(f"no hint this time: {type(e).__name__}: {e}")
    return 0
