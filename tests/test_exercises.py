"""Every exercise, graded three ways: its stubs score 0, minidist's reference full marks, and
a solution written apart from minidist the way its chapter teaches (tests/solutions/) full
marks. Generic over the exercises present, so a new chapter's exercise is covered here.
"""

import ast
import inspect
import re
from pathlib import Path

import pytest

from exercises.grader import core

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = sorted(core.available())
SOLUTIONS = Path(__file__).resolve().parent / "solutions"


def test_exercises_are_found():
    assert "01" in EXERCISES  # a broken discovery would skip every test below


@pytest.mark.parametrize("nn", EXERCISES)
def test_the_learner_file_reads_in_a_minute(nn):
    path = core.learner_file(nn)
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.splitlines()) <= 45, f"{path.name}: docstring of {len(doc.splitlines())} lines"
    assert f"python -m exercises.grade {nn}" in doc, "say how to grade it"
    assert re.search(r"chapters/\d\d_\w+\.md", doc) and "section" in doc, "name the chapter section to read"
    assert "README" in doc, "point to the README's rules"
    for name, target in core.reference_table(path).items():
        assert callable(core.resolve(target)), f"REFERENCE {name} -> {target} does not resolve"


@pytest.mark.parametrize("nn", EXERCISES)
def test_stubs_score_zero(nn):
    r = core.grade(nn)
    assert r.total == len(core.checks_of(nn)) > 0 and r.points == 0, [c.message for c in r.checks if c.ok]
    for c in r.checks:
        if c.name.startswith("find the bug"):  # the stub is the broken code: it must fail
            assert c.message and "not implemented" not in c.message, f"{c.name}: {c.message}"
        else:  # every check reaches the stub, not failing on its own before calling it
            assert c.message.startswith("not implemented: "), f"{c.name}: {c.message}"


@pytest.mark.parametrize("nn", EXERCISES)
def test_the_reference_scores_full(nn):
    r = core.grade(nn, reference=True)
    assert r.points == r.max_points, [(c.name, c.message) for c in r.checks if not c.ok]


@pytest.mark.parametrize("nn", EXERCISES)
def test_a_solution_written_from_the_chapter_scores_full(nn):
    path = SOLUTIONS / f"{core.available()[nn]}.py"
    assert path.exists(), f"tests/solutions/{path.name}: a solution the way chapter {nn} teaches it"
    r = core.grade(nn, path=path)
    assert r.points == r.max_points, [(c.name, c.message) for c in r.checks if not c.ok]


@pytest.mark.parametrize("nn", EXERCISES)
def test_hints_are_tiered_and_never_the_code(nn):
    """Every check has hints, the first a question; no hint holds a line of the answer."""
    answer = set()
    for target in core.reference_table(core.learner_file(nn)).values():
        answer |= {ln.strip() for ln in inspect.getsource(core.resolve(target)).splitlines()
                   if len(ln.strip()) >= 24 and not ln.strip().startswith(("#", '"', "'"))}
    for c in core.checks_of(nn):
        hints = core.hints_of(nn, c)
        assert hints and "?" in hints[0], f"{c.name}: the first hint asks a question"
        leaked = [ln for h in hints for ln in answer if ln in h]
        assert not leaked, f"{c.name}: a hint holds the answer's code: {leaked[0]}"
