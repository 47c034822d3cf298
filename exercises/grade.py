"""Grade the exercises: `python -m exercises.grade [NN ...] [--reference] [--hint [K]]`.

An exercise is a file exercises/NN_name.py: stub functions, and a REFERENCE dict naming
minidist's implementation of each ("module:attribute"), which `--reference` grades
instead. Its checks are functions registered with `@check("NN", points)`, here or in
exercises/checks_NN.py (imported when it exists): each takes the implementation under
test (a namespace, one attribute per REFERENCE name) and raises AssertionError saying
what is wrong. Checks compare against an oracle (a model built here, a measurement, a
formula written here independently), never against numbers copied from a run.
tests/test_exercises.py proves for every exercise that its stubs score 0 and minidist
scores full. A finished grading run exits 0 whatever the score; bad arguments exit 2.

This process never runs the learner's code: it reads their file first (exercises/_filecheck.py:
a file that names what its exercise forbids scores 0, unrun), then grades references to it
that are loaded on the ranks or in a child forked per check, under a time limit
(exercises/_learner.py). The report is this process's, printed after those are gone.

Hints are tiered and asked for: `--hint` grades, then shows the next hint of the first
failing check (the first call its first hint, the next call the second, ...), `--hint K`
its K-th. The last tier stops short of the finished code: the answer itself is a
separate, explicit command, `--reference`, which grades minidist's implementation named
in the file's REFERENCE (where to read it). A check's hints are `@check(..., hints=[...])`,
or an entry of a `HINTS` dict in exercises/checks_NN.py keyed by the check function's
name (or the check's name). How
many hints of each check were shown is kept in a small JSON file outside the repository,
$XDG_CACHE_HOME/minidist/hints.json (~/.cache/minidist/hints.json when unset;
MINIDIST_HINT_STATE names another file), so a learner's clone stays clean.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from exercises import _learner



HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- registry

@dataclass
class Check:
    name: str
    points: int
    fn: Callable[[SimpleNamespace], None]
    hints: list[str] = field(default_factory=list)


CHECKS: dict[str, list[Check]] = {}


def check(nn: str, points: int = 1, name: str | None = None, hints: list[str] | None = None):
    """Register a graded check of exercise `nn`, worth `points` when it passes, with its
    tiered hints (first the gentlest)."""
    def register(fn):
        CHECKS.setdefault(nn, []).append(Check(name or fn.__name__, points, fn, list(hints or [])))
        return fn
    return register


def hints_of(nn: str, c: Check) -> list[str]:
    """The hints of check `c`: its own, else exercises/checks_NN.py's HINTS entry."""
    if c.hints:
        return c.hints
    mod = sys.modules.get(f"exercises.checks_{nn}")
    table = getattr(mod, "HINTS", {}) or {}
    return list(table.get(c.fn.__name__) or table.get(c.name) or [])


def available() -> dict[str, str]:
    """{"01": "01_gpt", ...}: the exercise files present in exercises/."""
    found = (re.fullmatch(r"(\d\d)_\w+\.py", p.name) for p in sorted(HERE.iterdir()))
    return {m.group(1): m.group(0)[:-3] for m in found if m}


def checks_of(nn: str) -> list[Check]:
    # Long check suites live in exercises/checks_NN.py, which registers on (first) import.
    if importlib.util.find_spec(f"exercises.checks_{nn}") is not None:
        importlib.import_module(f"exercises.checks_{nn}")
    return CHECKS.get(nn, [])


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def learner_file(nn: str) -> Path:
    """The learner's file of exercise `nn` (tests point it elsewhere)."""
    return HERE / f"{available()[nn]}.py"


def reference_table(path: Path) -> dict:
    """The file's REFERENCE dict, read from its syntax tree: the grading process never
    imports the learner's file (exercises/_learner.py says where it runs)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "REFERENCE"
                                                for t in node.targets):
            return dict(ast.literal_eval(node.value))
    raise ValueError(f"{path.name} has no REFERENCE dict (leave it as it is)")


def implementation(nn: str, reference: bool = False, overrides: dict | None = None):
    """The functions to grade: the learner's (as references to their file, loaded only
    where the learner's code runs), or minidist's with reference=True."""
    path = learner_file(nn)
    table = reference_table(path)
    if reference:
        impl = {n: _resolve(target) for n, target in table.items()}
    else:
        impl = {n: _learner.LearnerRef.of(path, f"exercises.{available()[nn]}", n) for n in table}
    impl.update(overrides or {})
    return SimpleNamespace(**impl)


# --------------------------------------------------------------------------- grading

@dataclass
class CheckResult:
    name: str
    ok: bool
    points: int
    max_points: int
    message: str = ""
    output: str = ""  # what the learner's code printed while this check ran apart


@dataclass
class Result:
    nn: str
    name: str
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    passed = property(lambda self: sum(c.ok for c in self.checks))
    total = property(lambda self: len(self.checks))
    points = property(lambda self: sum(c.points for c in self.checks))
    max_points = property(lambda self: sum(c.max_points for c in self.checks))


def rules_of(nn: str):
    """The exercise's rules (an exercises._rules.Rules in checks_NN.py's RULES), or None."""
    return getattr(sys.modules.get(f"exercises.checks_{nn}"), "RULES", None)


def _verdict(c: Check, impl: SimpleNamespace, rules=None) -> tuple[bool, str]:
    """(passed, message) of check `c` on `impl`, run in this process under the rules."""
    # The check runs under the exercise's rules too: what it runs in this process (the
    # single-process checks) breaks them as a part on the ranks would (exercises/_rules.py)
    from exercises import _rules
    w = None
    try:
        with _rules.watching(rules) as w:
            c.fn(impl)
        if not w.broken:
            return True, ""
        msg = f"{w.broken[0]} (this check scores 0)"
    except NotImplementedError as e:  # still a stub: show its hint
        msg = f"not implemented: {e}"
    except AssertionError as e:
        msg = str(e) or "assertion failed"
    except Exception as e:  # a crash in the code under test fails its check, not the run
        msg = f"{type(e).__name__}: {e}"
    if w is not None and w.broken and "scores 0" not in msg:
        msg = f"{w.broken[0]} (this check scores 0)"
    return False, msg


# The longest one check may run in the child that runs the learner's code in one process
# (exercises/_learner.py); the multi-process parts have their own watchdogs. Tests lower it.
CHECK_TIME_LIMIT_S = float(os.environ.get("MINIDIST_CHECK_TIME_LIMIT", 60))


def _run(c: Check, impl: SimpleNamespace, rules=None, limit_s: float | None = None) -> CheckResult:
    """Run check `c`. Here when it only hands the learner's code to the ranks; in a child
    of its own, under a time limit, when it calls that code in this process."""
    try:
        ok, msg = _verdict(c, impl, rules)
        printed = ""
    except _learner.InProcess:
        ok, msg, printed = _learner.run_apart(lambda real: _verdict(c, real, rules), c.name, impl,
                                              CHECK_TIME_LIMIT_S if limit_s is None else limit_s)
    if ok:
        return CheckResult(c.name, True, c.points, c.points, output=printed)
    return CheckResult(c.name, False, 0, c.points, msg, output=printed)


def file_problems(nn: str) -> list[str]:
    """What the learner's file of exercise `nn` may not name (exercises/_filecheck.py),
    read from its syntax tree before anything in it runs."""
    from exercises import _filecheck
    checks_of(nn)  # its rules (RULES, IDEA_MODULES, IDEA_ALLOWED) live in exercises/checks_NN.py
    path = learner_file(nn)
    try:
        targets = tuple(reference_table(path).values())
    except SyntaxError:
        targets = ()
    except Exception:  # no REFERENCE: the load fails below, saying so
        targets = ()
    return _filecheck.of_exercise(nn, path, sys.modules.get(f"exercises.checks_{nn}"), targets)


def grade(nn: str, reference: bool = False, overrides: dict | None = None) -> Result:
    """Run every check of exercise `nn`; `overrides` replaces single functions (tests)."""
    known = available()
    if nn not in known:
        raise KeyError(f"no exercise {nn!r}; available: {', '.join(known) or 'none'}")
    t0, result = time.perf_counter(), Result(nn, known[nn])
    checks = checks_of(nn)
    problems = [] if reference else file_problems(nn)
    if problems:  # read before anything runs: a file that breaks a rule scores 0, unrun
        result.checks = [CheckResult(c.name, False, 0, c.points, problems[0]) for c in checks]
        result.seconds = time.perf_counter() - t0
        return result
    try:
        impl = implementation(nn, reference, overrides)
    except Exception as e:  # the student's file does not load: every check fails, saying why
        why = f"exercises/{known[nn]}.py does not load: {type(e).__name__}: {e}"
        result.checks = [CheckResult(c.name, False, 0, c.points, why) for c in checks]
    else:
        result.checks = [_run(c, impl, rules_of(nn)) for c in checks]
    result.seconds = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------- command line

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
    # Printed by the grading process after every process that ran the learner's code is
    # gone: a table the learner's code printed appears above, marked as theirs.
    lines.append(f"Report of the grading process (pid {os.getpid()}); your code ran in other processes.")
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
    """(the hint counts, a message when the file was damaged and is reset)."""
    path = hint_state_path()
    try:
        text = path.read_text()
    except FileNotFoundError:  # none yet
        return {}, ""
    except (OSError, ValueError) as e:  # unreadable (a folder, no permission, not text)
        return {}, f"(the hint state {path} could not be read ({type(e).__name__}); counting hints from 1 again)"
    try:
        state = json.loads(text)
        if not isinstance(state, dict) or not all(isinstance(k, str) and type(v) is int
                                                  for k, v in state.items()):
            raise ValueError("not a table of counts")
        return state, ""
    except ValueError:
        return {}, f"(the hint state {path} was damaged and is reset; counting hints from 1 again)"


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


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: the checks register
    # themselves on `exercises.grade`, and two copies would mean two registries.
    from exercises import grade as _grade
    sys.exit(_grade.main())
