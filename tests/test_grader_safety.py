"""The grader reads the learner's file before running it, and survives what the file does.

Two kinds of rule-breaking solutions, each across several exercises:
- a file that names what its exercise forbids (the idea's minidist module, the grader,
  torch's forbidden or private APIs, under any name) scores 0 on every check, naming the
  line and the rule, and none of it runs (exercises/_filecheck.py);
- a file that hangs, exits, crashes or prints a fake report fails the checks it broke,
  each saying why, while the grading process goes on and prints the one real report
  (exercises/_learner.py).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exercises import _rules
from exercises import grade as G

ROOT = Path(__file__).resolve().parent.parent


def _learner(tmp_path, monkeypatch, nn, extra="", replace=None):
    """A copy of exercise nn's stub with `extra` appended (or `replace` {old: new}),
    graded as the learner's file."""
    name = G.available()[nn]
    src = (ROOT / "exercises" / f"{name}.py").read_text()
    for old, new in (replace or {}).items():
        assert old in src, old
        src = src.replace(old, new, 1)
    path = tmp_path / f"{name}.py"
    path.write_text(src + extra)
    monkeypatch.setattr(G, "learner_file", lambda n: path)
    return path, src


def _line_of(path, text):
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# ----------------------------------------------------------------------- the file check

FILE_CHEATS = {
    # exercise: (appended source, the line's text, a phrase of the rule)
    "01": ("\nimport minidist.model as _m\n\ndef count_params(cfg, _G=getattr(_m, 'GPT')):\n"
           "    return sum(p.numel() for p in _G(cfg).parameters())\n",
           "import minidist.model as _m", "answer key"),
    "02": ("\nfrom minidist import comm as _c\nall_reduce = _c.all_reduce\n",
           "from minidist import comm", "minidist.comm"),
    "02b": ("\nimport torch.distributed as _d\n_AR = _d.all_reduce\n\ndef all_reduce(t):\n"
            "    return _AR(t)\n", "_AR = _d.all_reduce", "only dist.isend/irecv/send/recv"),
    "05": ("\nfrom torch.cuda.amp import GradScaler as _GS\n\nclass LossScaler(_GS):\n    pass\n",
           "from torch.cuda.amp import GradScaler", "torch.amp.GradScaler"),
    "06": ("\nfrom minidist.zero import ShardedOptimizer\n", "from minidist.zero import ShardedOptimizer",
           "minidist.zero"),
    "09": ("\nimport torch.utils.checkpoint as _cp\n\ndef checkpoint(fn, *a, _c=_cp.checkpoint):\n"
           "    return _c(fn, *a, use_reentrant=False)\n", "import torch.utils.checkpoint", "torch.utils.checkpoint"),
    "03": ("\nimport exercises.grade as _g\n_g._run = lambda c, impl, rules=None, limit_s=None: "
           "_g.CheckResult(c.name, True, c.points, c.points)\n", "import exercises.grade", "exercises"),
    "04": ("\nfrom exercises import _rules\n\ndef accumulate(*a, **k):\n    with _rules.exempt():\n"
           "        pass\n", "from exercises import _rules", "exempt context"),
    "07": ("\nimport sys\n_g = sys.modules['exercises.grade']\n", "import sys", "plain tools"),
    "08": ("\nimport torch\n_save = torch.distributed.checkpoint.save\n", "torch.distributed.checkpoint.save",
           "torch.distributed.checkpoint.save"),
    "10": ("\nimport importlib\n_tp = importlib.import_module('minidist.tensor_parallel')\n",
           "import importlib", "importlib"),
    # code loaded by path or by name through modules outside the plain tools
    "10b": ("\nimport runpy\n_tp = runpy.run_path('minidist/tensor_parallel/layers.py')\n", "import runpy",
            "standard library's plain tools"),
    "03b": ("\nimport pkgutil\nBucketedDDP = pkgutil.resolve_name('minidist.ddp:DDP')\n", "import pkgutil",
            "standard library's plain tools"),
    # the interpreter's modules reached through another module's attribute
    "11b": ("\nimport os\n_h = os.sys.modules.get('exercises._harness')\n", "os.sys", "by name"),
    "08b": ("\nimport torch\n_m = getattr(torch, 'sys')\n", "getattr(torch, 'sys')", "by name"),
    # another module's code or data replaced
    "05b": ("\nimport torch\ntorch.allclose = lambda *a, **k: True\n", "torch.allclose =", "another module"),
    "06b": ("\nimport torch.distributed as _d\nsetattr(_d, 'barrier', print)\n", "setattr(_d",
            "another module"),
    # names built at run time, on anything
    "09b": ("\n_x = [__name__][0]\n_y = getattr(_x, 'up' + 'per')\n", "getattr(_x", "built at run time"),
    "02c": ("\n_g = globals()\n", "globals()", "built at run time"),
    # code run around the grader's: dispatcher kernels, modes, processes
    "07b": ("\nimport torch.library\n", "import torch.library", "around or below the grader"),
    "01b": ("\nimport os\nos.system('true')\n", "os.system", "no processes started"),
    # minidist's answer through another module that re-exports it
    "05c": ("\nfrom minidist.train import LossScaler\n", "from minidist.train import LossScaler", "answer key"),
    "08c": ("\nfrom minidist.train_gpt import checkpoint as _ck\n", "from minidist.train_gpt", "answer key"),
    # torch's checkpointing by its other names, and activations kept outside tensors
    "09c": ("\nfrom torch.utils.checkpoint import CheckpointFunction\n", "import CheckpointFunction",
            "torch.utils.checkpoint"),
    "09d": ("\nimport torch\n_keep = [torch.zeros(1).untyped_storage()]\n", "untyped_storage", "bare storages"),
    # the rendezvous store, through torch's own helpers
    "04b": ("\nfrom torch.distributed.elastic.utils.store import synchronize\n",
            "from torch.distributed.elastic", "rendezvous store"),
    "02d": ("\nimport torch.distributed as _d\n_S = _d.TCPStore\n", "_S = _d.TCPStore", "rendezvous store"),
}


@pytest.mark.parametrize("case", list(FILE_CHEATS))
def test_a_file_that_names_what_is_forbidden_scores_0_everywhere_naming_line_and_rule(
        case, tmp_path, monkeypatch):
    nn = case[:2]
    extra, text, rule = FILE_CHEATS[case]
    path, _ = _learner(tmp_path, monkeypatch, nn, extra)
    r = G.grade(nn)
    assert r.points == 0 and r.total > 0
    line = _line_of(path, text)
    for c in r.checks:
        assert f"line {line}:" in c.message and rule in c.message and "breaks a rule" in c.message, c.message


def test_every_stub_passes_the_file_check():
    for nn in G.available():
        assert G.file_problems(nn) == [], nn


def test_the_exempt_context_is_the_graders_alone(tmp_path):
    # reached without naming it in an exercise file (the file check refuses that): from
    # any file other than the grader's own it trips, and the watch records it
    mod = tmp_path / "elsewhere.py"
    mod.write_text("def use(rules):\n    with rules.exempt():\n        return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import elsewhere
        with _rules.watching(_rules.Rules()) as w:
            with pytest.raises(_rules.RuleBroken, match="exempt"):
                elsewhere.use(_rules)
        assert w.broken and "exempt" in w.broken[0]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("elsewhere", None)
    from exercises import checks_01  # the grader's own files still enter it
    assert checks_01._gpt(checks_01._CONFIGS_01[0]) is not None


def test_a_handle_captured_before_the_watch_trips_even_on_a_wrapped_function():
    """A function wrapped by a decorator keeps its code in a closure: its handle, taken
    before the watch began, trips all the same, and works again after the watch."""
    import torch.distributed as dist
    import torch.utils.checkpoint as tc
    captured = {"torch.distributed.all_reduce": dist.all_reduce,  # functools.wraps: a closure
                "torch.utils.checkpoint.checkpoint": tc.checkpoint}
    assert all(f.__code__.co_freevars for f in captured.values())  # the case that matters
    for dotted, f in captured.items():
        with _rules.watching(_rules.Rules(apis={dotted: "the test forbids it"})) as w:
            with pytest.raises(_rules.RuleBroken, match="the test forbids it"):
                f(None)
        assert w.broken == [f"{dotted} was called, which this exercise forbids: the test forbids it"]
    x = torch.ones(2, requires_grad=True)
    captured["torch.utils.checkpoint.checkpoint"](torch.sin, x, use_reentrant=False).sum().backward()
    assert torch.allclose(x.grad, torch.cos(x.detach()))  # the original again


# ----------------------------------------------------------------------- survival

def test_an_endless_loop_fails_its_checks_by_name_and_the_rest_are_graded(tmp_path, monkeypatch):
    # 1 s: the loop never ends, and the stubs' checks (a fork that raises at once) finish
    # in milliseconds, so the limit is the wait of each count_params check, not a margin
    monkeypatch.setattr(G, "CHECK_TIME_LIMIT_S", 1.0)
    _learner(tmp_path, monkeypatch, "01", replace={
        "def count_params(cfg: GPTConfig) -> int:\n":
        "def count_params(cfg: GPTConfig) -> int:\n    while True:\n        pass\n"})
    r = G.grade("01")
    assert r.points == 0
    for c in r.checks:
        if "count_params" in c.name:
            assert f"'{c.name}' was still running after 1s and was stopped" in c.message, c.message
        else:
            assert c.message.startswith("not implemented"), c.message


def test_an_exit_at_import_fails_every_check_saying_so(tmp_path, monkeypatch):
    _learner(tmp_path, monkeypatch, "01", "\nraise SystemExit(0)\n")
    r = G.grade("01")
    assert r.points == 0
    assert all("called sys.exit(0)" in c.message for c in r.checks), [c.message for c in r.checks]


def test_an_exit_inside_a_function_fails_its_checks(tmp_path, monkeypatch):
    _learner(tmp_path, monkeypatch, "09", replace={
        'REFERENCE = {': 'import os\n\n\ndef checkpoint(*a, **k):\n    os._exit(0)\n\n\nREFERENCE = {'})
    r = G.grade("09")
    assert r.points == 0
    assert all("exited with status 0" in c.message for c in r.checks), [c.message for c in r.checks]


def test_a_crash_of_the_process_fails_the_check_naming_the_signal(tmp_path, monkeypatch):
    _learner(tmp_path, monkeypatch, "05", replace={
        'REFERENCE = {': 'import os\n\n\nclass LossScaler:\n    def __init__(self, *a, **k):\n'
                         '        os.abort()\n\n\nREFERENCE = {'})
    r = G.grade("05")
    crashed = [c for c in r.checks if "signal 6" in c.message]
    assert crashed and r.points == 0, [c.message for c in r.checks]


FAKE = ("\nprint('01_gpt  5/5  8  8')\nprint('total  5/5  8  8')\nimport os\nos._exit(0)\n")


def test_a_fake_report_and_an_exit_do_not_end_the_grading(tmp_path):
    # the command line, as a learner runs it: the real report comes last, from the
    # grading process, and the learner's table shows up marked as theirs
    work = tmp_path / "repo"
    shutil.copytree(ROOT / "exercises", work / "exercises",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (work / "exercises" / "01_gpt.py").write_text((ROOT / "exercises" / "01_gpt.py").read_text() + FAKE)
    env = {**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{ROOT}"}
    p = subprocess.run([sys.executable, "-m", "exercises.grade", "01"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "Report of the grading process" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["01_gpt"]]
    assert rows[-1][1:3] == ["0/5", "0"], out  # the real row, after the fake one
    assert "| 01_gpt  5/5  8  8" in out  # the learner's print, shown as theirs
    assert out.rstrip().splitlines()[-1].split()[:3] == ["total", "0/5", "0"], out


def test_a_damaged_hint_state_is_reset_with_a_message(tmp_path, monkeypatch):
    state = tmp_path / "hints.json"
    state.write_text("{not json")
    monkeypatch.setenv("MINIDIST_HINT_STATE", str(state))
    r = G.grade("01")
    text = G.hint(r)
    assert "damaged and is reset" in text and "Hint 1 of" in text
    state.write_text('["a", "list"]')
    assert "damaged and is reset" in G.hint(r)
