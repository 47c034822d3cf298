"""The grader itself: learner code runs apart and cannot stop the grading, rules are judged
per check and name the line, the command line and the hints. Exercise 01 serves as the
learner file throughout (one process, milliseconds a check)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exercises.grader import cli, core
from exercises.grader.rules import RuleBroken, Rules, watch

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "exercises" / "01_gpt.py"


def _learner(tmp_path, append: str = "", replace: dict | None = None) -> Path:
    text = STUB.read_text()
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "01_gpt.py"
    path.write_text(text + append)
    return path


def _body(name: str, code: str) -> dict:
    """Replace the stub's body of `name` (its first line) with `code`."""
    text = STUB.read_text()
    start = text.index(f"def {name}(")
    line = text.index("\n", start) + 1
    return {text[start:line]: text[start:line] + "".join(f"    {c}\n" for c in code.splitlines())}


def test_an_endless_loop_fails_its_checks_by_name_and_the_rest_are_graded(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "CHECK_TIME_LIMIT_S", 1.0)
    r = core.grade("01", path=_learner(tmp_path, replace=_body("count_params", "while True:\n    pass")))
    assert r.points == 0
    for c in r.checks:
        if "count_params" in c.name:
            assert f"'{c.name}' was still running after 1s and was stopped" in c.message, c.message
        else:
            assert c.message.startswith("not implemented"), c.message


@pytest.mark.parametrize("append, says", [
    ("\nraise SystemExit(0)\n", "called sys.exit(0)"),
    ("\nimport os\nos._exit(0)\n", "exited with status 0"),
    ("\nimport os\nos.abort()\n", "killed by signal 6"),
    ("\ndef broken(:\n", "does not load (line"),
])
def test_code_that_exits_crashes_or_does_not_parse_fails_every_check_saying_so(tmp_path, append, says):
    r = core.grade("01", path=_learner(tmp_path, append))
    assert r.points == 0 and all(says in c.message for c in r.checks), [c.message for c in r.checks]


def test_what_the_learner_prints_is_kept_capped_and_marked_as_theirs(tmp_path):
    r = core.grade("01", path=_learner(tmp_path, replace=_body(
        "count_params", "print('01_gpt  5/5  8  8')\nprint('x' * 100_000)\nraise NotImplementedError('no')")))
    c = next(c for c in r.checks if "count_params" in c.name)
    assert c.output.startswith("01_gpt  5/5  8  8"), c.output[:200]
    assert "more bytes of output cut" in c.output and len(c.output) < 30_000, len(c.output)
    text = cli.report([r], reference=False)
    assert "| 01_gpt  5/5  8  8" in text  # shown as the learner's, not as a row of the report
    assert text.rstrip().splitlines()[-1].split()[:3] == ["total", "0/5", "0"], text[-500:]


def test_a_forbidden_call_scores_its_check_0_naming_the_call_and_its_line(tmp_path):
    # count_params builds the model (exercise 01 forbids it); flops_per_token is right
    fixed = _body("count_params", "from minidist.model import GPT\nreturn GPT(cfg).get_num_params()")
    r = core.grade("01", path=_learner(tmp_path, replace=fixed))
    broken = [c for c in r.checks if "count_params" in c.name]
    line = next(i for i, t in enumerate((tmp_path / "01_gpt.py").read_text().splitlines(), 1)
                if "GPT(cfg).get_num_params()" in t)
    for c in broken:
        assert "minidist.model.GPT was called" in c.message and f"01_gpt.py:{line}" in c.message, c.message
        assert "build no model" in c.message  # what to do instead
    others = [c for c in r.checks if c not in broken]
    assert all(c.message.startswith("not implemented") for c in others)  # those are not zeroed by it


def test_the_rules_judge_the_code_under_test_not_the_grader_and_only_inside_a_watch(tmp_path):
    mod = tmp_path / "learner_mod.py"
    mod.write_text("import torch.utils.checkpoint as cp\n\n\ndef f(x):\n    return cp.checkpoint(torch_sin, x, use_reentrant=False)\n\n\n"
                   "import torch\ntorch_sin = torch.sin\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import learner_mod
        rules = Rules(forbidden={"torch.utils.checkpoint:checkpoint": "write it yourself"})
        x = torch.ones(2, requires_grad=True)
        with watch(rules) as w, pytest.raises(RuleBroken):
            learner_mod.f(x)
        assert len(w.broken) == 1 and "torch.utils.checkpoint.checkpoint was called at" in w.broken[0]
        assert "learner_mod.py:5, which this exercise forbids: write it yourself" in w.broken[0]
        learner_mod.f(x).sum().backward()  # outside a watch: torch's own function, unchanged
        assert torch.allclose(x.grad, torch.cos(x.detach()))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("learner_mod", None)


# ----------------------------------------------------------------------- the command line

def test_the_command_line_grades_and_refuses_bad_arguments(capsys):
    assert cli.main(["01", "--reference"]) == 0  # what `python -m exercises.grade` runs, in this process
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].split()[:3] == ["total", "5/5", "8"], out
    for bad, says in ((["99"], "unknown exercise '99'"), (["01", "02", "--hint"], "needs one exercise"),
                      (["01", "--hint", "-1"], "counts from 1")):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(bad)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_hints_come_one_at_a_time_and_a_damaged_state_is_reset(tmp_path, monkeypatch):
    state = tmp_path / "hints.json"
    monkeypatch.setenv("MINIDIST_HINT_STATE", str(state))
    r = core.grade("01")
    first, second = cli.hint(r), cli.hint(r)
    assert "Hint 1 of" in first and "Hint 2 of" in second
    assert "Hint 1 of" in cli.hint(r, 1)
    state.write_text("{not json")
    assert "damaged and is reset" in cli.hint(r) and "Hint 1 of" in cli.hint(r, 1)


def _alive(pid: int) -> bool:
    try:  # a zombie no one has reaped yet is gone all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_stopping_the_grader_ends_the_process_running_the_learners_code(tmp_path):
    work = tmp_path / "repo"  # the grader as it is, the learner's file looping
    shutil.copytree(ROOT / "exercises", work / "exercises", ignore=shutil.ignore_patterns("__pycache__"))
    _learner(tmp_path, replace=_body("count_params", "while True:\n    pass")).rename(work / "exercises" / "01_gpt.py")
    proc = subprocess.Popen([sys.executable, "-m", "exercises.grade", "01"], cwd=work,
                            env={**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{ROOT}"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (kids := _children(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)  # a bounded wait for the check's child to start, not a timing test
        assert kids, "the grader never started a child for the check"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        for _ in range(100):
            if not any(_alive(k) for k in kids):
                break
            time.sleep(0.1)
        assert not any(_alive(k) for k in kids), "the learner's process outlived the grader"
    finally:
        proc.kill()
        proc.wait()
