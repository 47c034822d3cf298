"""The exercise frame works: stubs score 0, minidist scores full, the checks can fail.

Generic over every exercises/NN_name.py present, so a chapter that adds an exercise is
covered here without editing this file. Graded by `python -m exercises.grade`.
"""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exercises import grade as G

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = sorted(G.available())


def test_exercises_are_found():
    assert "01" in EXERCISES  # the warm-up; a broken discovery would skip every test below


@pytest.mark.parametrize("nn", EXERCISES)
def test_exercise_declares_stubs_references_and_checks(nn):
    mod = importlib.import_module(f"exercises.{G.available()[nn]}")
    assert mod.__doc__ and "python -m exercises.grade" in mod.__doc__, "say how to grade it"
    assert mod.REFERENCE, "REFERENCE names minidist's implementation of each stub"
    for name, target in mod.REFERENCE.items():
        assert callable(getattr(mod, name)), f"stub {name} missing"
        assert callable(G._resolve(target)), f"reference {target} does not resolve"
    checks = G.checks_of(nn)
    assert checks, f"exercise {nn} has no graded checks"
    assert all(c.points > 0 for c in checks)
    assert len({c.name for c in checks}) == len(checks), "check names must be distinct"


def test_every_registered_check_belongs_to_an_exercise():
    for nn in EXERCISES:
        G.checks_of(nn)  # loads exercises/checks_NN.py where there is one
    assert set(G.CHECKS) <= set(EXERCISES), "checks registered for a missing exercise file"


@pytest.mark.parametrize("nn", EXERCISES)
def test_stubs_score_zero_and_show_their_hint(nn, monkeypatch):
    if nn == "11":  # its draft deadlocks: the watchdog test_exercise_11.py uses (2 s a case),
        from exercises import checks_11  # so that the grading cached there serves here too
        monkeypatch.setattr(checks_11, "CASE_TIMEOUT_S", 2.0)
    r = G.grade(nn)
    assert r.total == len(G.checks_of(nn)) and r.passed == 0 and r.points == 0
    assert r.max_points == sum(c.points for c in G.checks_of(nn)) > 0
    for c in r.checks:
        if c.name.startswith("find the bug"):  # the stub is the broken code: it must fail
            assert c.message and "not implemented" not in c.message, f"{c.name}: {c.message}"
            continue
        # every check must reach the stub, not fail on its own before calling it
        assert c.message.startswith("not implemented: "), f"{c.name}: {c.message}"
        assert len(c.message) > len("not implemented: ") + 10, f"{c.name}: stub gives no hint"


@pytest.mark.parametrize("nn", EXERCISES)
def test_reference_scores_full(nn):
    r = G.grade(nn, reference=True)
    failed = {c.name: c.message for c in r.checks if not c.ok}
    assert not failed, failed
    assert r.passed == r.total > 0 and r.points == r.max_points > 0


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "exercises.grade", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _table_row(stdout, name):
    """The summary row of one exercise: name, tests passed, points, total."""
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] == [name]]
    assert rows, f"no row for {name} in:\n{stdout}"
    return rows[-1]


def test_cli_reference_prints_full_points():
    p = _cli("01", "--reference")
    assert p.returncode == 0, p.stderr
    assert "exercise" in p.stdout and "tests passed" in p.stdout and "points" in p.stdout
    n, pts = len(G.checks_of("01")), sum(c.points for c in G.checks_of("01"))
    assert _table_row(p.stdout, "01_gpt") == ["01_gpt", f"{n}/{n}", str(pts), str(pts)]
    assert _table_row(p.stdout, "total") == ["total", f"{n}/{n}", str(pts), str(pts)]


def test_cli_stubs_score_zero_and_still_exit_0():
    p = _cli("1")  # "1" means 01 too
    assert p.returncode == 0, "a low score is a result, not an error"
    n, pts = len(G.checks_of("01")), sum(c.points for c in G.checks_of("01"))
    assert _table_row(p.stdout, "01_gpt") == ["01_gpt", f"0/{n}", "0", str(pts)]
    assert "not implemented" in p.stdout


@pytest.mark.parametrize("nn", EXERCISES)
def test_every_check_of_an_exercise_with_hints_has_them(nn):
    assert all(G.hints_of(nn, c) for c in G.checks_of(nn)), [c.name for c in G.checks_of(nn)
                                                             if not G.hints_of(nn, c)]


def test_cli_hint_shows_the_next_hint_of_the_first_failing_check(tmp_path, monkeypatch, capsys):
    # the command line's main, in this process (the two tests above run `python -m
    # exercises.grade` itself): four gradings of 01 without four interpreter starts
    monkeypatch.setenv("MINIDIST_HINT_STATE", str(tmp_path / "hints.json"))

    def run(*a):
        assert G.main(list(a)) == 0
        return capsys.readouterr().out
    first, second, again = run("01", "--hint"), run("01", "--hint"), run("01", "--hint", "1")
    assert "Hint 1 of" in first and "count_params" in first, first
    assert "Hint 2 of" in second or "Hint 1 of 1" in second, second
    assert "Hint 1 of" in again
    assert (tmp_path / "hints.json").exists()
    with pytest.raises(SystemExit) as e:
        G.main(["01", "02", "--hint"])  # one exercise at a time
    assert e.value.code == 2 and "--hint needs one exercise number" in capsys.readouterr().err


def test_cli_unknown_exercise_fails_with_the_list():
    p = _cli("99")
    assert p.returncode != 0
    assert "unknown exercise '99'" in p.stderr and "01 (01_gpt)" in p.stderr
    with pytest.raises(KeyError, match="available"):
        G.grade("99")


# Classic mistakes in exercise 01, each of which some check must catch. The correct
# functions come from minidist, the mistake is added on top.
def _mistakes():
    from minidist.model import config_num_params as n, flops_per_token as f
    pos = lambda c: c.block_size * c.n_embd  # noqa: E731
    return {
        "head counted twice": {"count_params": lambda c: n(c) + c.vocab_size * c.n_embd},
        "position table forgotten": {"count_params": lambda c: n(c) - pos(c)},
        "LayerNorm bias when bias=False": {"count_params": lambda c: n(c) + (0 if c.bias else
                                           (2 * c.n_layer + 1) * c.n_embd)},
        "position table in N": {"flops_per_token": lambda c, T: f(c, T) + 6 * pos(c)},
        "attention left out": {"flops_per_token": lambda c, T: 6 * (n(c) - pos(c))},
        "block_size for seq_len": {"flops_per_token": lambda c, T: f(c, c.block_size)},
        "forward only (2N)": {"flops_per_token": lambda c, T: f(c, T) - 4 * (n(c) - pos(c))},
        "peak of one device": {"mfu": lambda fpt, tps, peak, n=1: fpt * tps / peak if peak else None},
        "0 for unknown peak": {"mfu": lambda fpt, tps, peak, n=1: fpt * tps / (peak * n) if peak else 0.0},
    }


@pytest.mark.parametrize("mistake", list(_mistakes()))
def test_wrong_implementation_loses_points(mistake):
    overrides = _mistakes()[mistake]
    r = G.grade("01", reference=True, overrides=overrides)
    assert 0 < r.points < r.max_points, f"{mistake}: {r.points}/{r.max_points}"
    # only checks of the broken function fail, and they say what was wrong
    for c in r.checks:
        if not c.ok:
            assert any(name in c.name for name in overrides), c.name
            assert re.search(r"got .*(want|has|gives|counts)", c.message), c.message


def test_a_crash_fails_its_checks_without_stopping_the_run():
    def boom(*a, **k):
        raise ZeroDivisionError("oops")
    r = G.grade("01", reference=True, overrides={"count_params": boom})
    crashed = [c for c in r.checks if not c.ok]
    assert crashed and all(c.message == "ZeroDivisionError: oops" for c in crashed)
    assert r.points > 0  # the other functions still earn theirs


@pytest.mark.parametrize("nn", EXERCISES)
def test_a_file_that_does_not_import_scores_zero_and_says_why(nn, monkeypatch):
    def broken(*a, **k):
        raise SyntaxError("invalid syntax (line 42)")
    monkeypatch.setattr(G, "implementation", broken)
    r = G.grade(nn)
    assert r.total > 0 and r.points == 0
    assert all("does not load: SyntaxError" in c.message for c in r.checks)
