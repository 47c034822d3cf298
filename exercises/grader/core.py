"""The grader's registry and its one loop: run each check of an exercise, collect a Result.

An exercise is exercises/NN_name.py: stubs, and a REFERENCE dict naming minidist's version
of each ("module:attribute"), which `--reference` grades. Its checks are functions in
exercises/grader/checks_NN.py registered with `@check("NN", points, hints=[...])`: each takes
the implementation (one attribute per REFERENCE name), runs it, compares what it did with an
oracle and raises AssertionError saying what differs, under the module's `RULES`.
"""

import ast
import hashlib
import importlib
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from exercises.grader import apart
from exercises.grader.rules import Rules, forbid, watch  # forbid: by way of rules, which it imports

EXERCISES = Path(__file__).resolve().parent.parent


@dataclass
class Check:
    name: str
    points: int
    fn: Callable[[SimpleNamespace], None]
    hints: list[str] = field(default_factory=list)
    rules: Rules | None = None


CHECKS: dict[str, list[Check]] = {}


def check(nn: str, points: int = 1, name: str | None = None, hints: list[str] | None = None,
          rules: Rules | None = None):
    """Register a graded check of exercise `nn`, worth `points` when it passes, with its
    tiered hints (a question, then a nudge, then the idea; never the code)."""
    def register(fn):
        CHECKS.setdefault(nn, []).append(
            Check(name or fn.__name__.replace("_", " "), points, fn, list(hints or []), rules))
        return fn
    return register


def available() -> dict[str, str]:
    """{"01": "01_gpt", ...}: the exercise files present in exercises/."""
    found = (re.fullmatch(r"(\d\d)_\w+\.py", p.name) for p in sorted(EXERCISES.iterdir()))
    return {m.group(1): m.group(0)[:-3] for m in found if m}


def checks_module(nn: str):
    return importlib.import_module(f"exercises.grader.checks_{nn}")


def checks_of(nn: str) -> list[Check]:
    checks_module(nn)  # registers on (first) import
    return CHECKS.get(nn, [])


def rules_of(nn: str, c: Check | None = None, reference: bool = False) -> Rules | None:
    """The rules a check runs under. minidist's reference is the answer itself, so what
    the rules forbid of minidist does not apply to it; torch's APIs stay forbidden."""
    rules = (c.rules if c and c.rules else None) or getattr(checks_module(nn), "RULES", None)
    if rules is not None and reference:
        rules = replace(rules, forbidden={k: v for k, v in rules.forbidden.items()
                                          if not k.startswith("minidist")})
    return rules


def resolve(target: str):
    return getattr(*forbid.resolve(target))


def learner_file(nn: str) -> Path:
    return EXERCISES / f"{available()[nn]}.py"


def reference_table(path: Path) -> dict:
    """The file's REFERENCE dict, read from its syntax tree (the grading process never
    imports the learner's file)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "REFERENCE"
                                                for t in node.targets):
            return dict(ast.literal_eval(node.value))
    raise ValueError(f"{path.name} has no REFERENCE dict (leave it as it is)")


def implementation(nn: str, reference: bool = False, path: Path | None = None,
                   overrides: dict | None = None) -> SimpleNamespace:
    """The functions to grade: the learner's file (or `path`), as references loaded only
    where the learner's code runs, or minidist's with reference=True."""
    path = Path(path or learner_file(nn))
    table = reference_table(learner_file(nn) if reference else path)
    if reference:
        impl = {name: resolve(target) for name, target in table.items()}
    else:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        module = f"exercises.learner_{nn}_{digest[:8]}"
        impl = {name: apart.LearnerRef(str(path), module, name, digest) for name in table}
    impl.update(overrides or {})
    return SimpleNamespace(**impl)


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


def _verdict(c: Check, impl: SimpleNamespace, rules: Rules | None) -> tuple[bool, str]:
    """(passed, message) of check `c` on `impl`, in this process, under the rules."""
    w, msg = None, ""
    try:
        with watch(rules) as w:
            c.fn(impl)
    except NotImplementedError as e:  # still a stub: show its hint
        msg = f"not implemented: {e}"
    except AssertionError as e:
        msg = str(e) or "assertion failed"
    except Exception as e:  # a crash in the code under test fails its check, not the run
        msg = f"{type(e).__name__}: {e}"
    if w is not None and w.broken:  # the rule is the message, not what followed from it
        msg = f"{w.broken[0]} (this check scores 0)"
    return not msg, msg


# The longest one check may run in its child; the ranks have their own watchdogs.
CHECK_TIME_LIMIT_S = float(os.environ.get("MINIDIST_CHECK_TIME_LIMIT", 60))


def run_check(c: Check, impl: SimpleNamespace, rules: Rules | None) -> CheckResult:
    """Here when the check only hands the learner's code to the ranks; in a child of its
    own, under a time limit, when it calls that code in this process."""
    try:
        ok, msg = _verdict(c, impl, rules)
        printed = ""
    except apart.InProcess:
        ok, msg, printed = apart.run_apart(lambda real: _verdict(c, real, rules), c.name,
                                           impl, CHECK_TIME_LIMIT_S)
    return CheckResult(c.name, ok, c.points if ok else 0, c.points, "" if ok else msg, printed)


def grade(nn: str, reference: bool = False, path: Path | str | None = None,
          overrides: dict | None = None) -> Result:
    """Run every check of exercise `nn` on the learner's file (or `path`, or minidist's
    reference); `overrides` replaces single functions (tests)."""
    known = available()
    if nn not in known:
        raise KeyError(f"no exercise {nn!r}; available: {', '.join(known) or 'none'}")
    t0, result = time.perf_counter(), Result(nn, known[nn])
    checks = checks_of(nn)
    try:
        impl = implementation(nn, reference, path, overrides)
    except Exception as e:  # the file does not parse: every check fails, saying why
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        why = f"{Path(path or learner_file(nn)).name} does not load{where}: {type(e).__name__}: {e}"
        result.checks = [CheckResult(c.name, False, 0, c.points, why) for c in checks]
    else:
        with apart.taking_children_along():
            result.checks = [run_check(c, impl, rules_of(nn, c, reference)) for c in checks]
    result.seconds = time.perf_counter() - t0
    return result


def hints_of(nn: str, c: Check) -> list[str]:
    """The hints of check `c` (the tiers registered with it)."""
    return c.hints
