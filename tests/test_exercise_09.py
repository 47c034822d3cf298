"""Exercise 09's grader: a solution that calls torch.utils.checkpoint scores 0, naming the
rule and the line, however it reaches it; each planted mistake loses its checks only.
(tests/test_exercises.py grades the stub, minidist and tests/solutions/09_memory.py.)
A variant is the solution with lines replaced.
"""

from pathlib import Path

import pytest

from exercises.grader import checks_09 as C9
from exercises.grader import core

SOLUTION = (Path(__file__).parent / "solutions" / "09_memory.py").read_text()
CHECK = {"grads": "gradients equal", "memory": "memory:", "dropout": "dropout:", "autocast": "autocast:"}
APPLY = "    return _Recompute.apply(fn, x, *fn.__self__.parameters())"

INPUT = C9.B * C9.T * C9.D * 4  # a block's input, fp32 bytes
MISTAKES = {  # name: ([(text in the solution, what replaces it)], the checks that must fail, a phrase)
    "no RNG restore": ([("            torch.set_rng_state(ctx.rng)\n", "")], {"dropout"}, "with dropout"),
    "the RNG restored, not forked": ([("with torch.random.fork_rng():", "with torch.enable_grad():")],
                                     {"dropout"}, "random numbers drawn after the step with dropout"),
    "no autocast replay": ([("with torch.autocast(kind, dtype=dtype, enabled=enabled), torch.enable_grad():",
                             "with torch.enable_grad():")], {"autocast"}, "under bf16 autocast"),
    "keeps the whole graph": ([(APPLY, "    return fn(x)")], {"memory"}, f"its input is {INPUT} bytes"),
    "saves an intermediate too": ([("ctx.save_for_backward(x)",
                                    "ctx.save_for_backward(x, fn.__self__.ln_1(x))"),
                                   ("(x,) = ctx.saved_tensors", "x = ctx.saved_tensors[0]")], {"memory"},
                                  f"block 0 keeps {2 * INPUT} bytes"),
    "parameters not inputs of apply": ([(APPLY, "    return _Recompute.apply(fn, x)")], set(CHECK), ""),
}

TORCH_CP = "torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)"
USES_TORCH = {  # name: (edits, the line that calls torch.utils.checkpoint)
    "by module": ([(APPLY, f"    return {TORCH_CP}")], TORCH_CP),
    "imported early": ([("import torch  # noqa: F401\n",
                         "import torch\nfrom torch.utils.checkpoint import checkpoint as cp\n"),
                        (APPLY, "    return cp(fn, x, use_reentrant=False)")], "return cp(fn"),
    "caught and worked around": ([(APPLY, f"    try:\n        return {TORCH_CP}\n"
                                          f"    except Exception:\n    {APPLY}")], TORCH_CP),
    "checkpoint_sequential": ([(APPLY, "    return torch.utils.checkpoint.checkpoint_sequential("
                                       "[fn], 1, x, use_reentrant=False)")], "checkpoint_sequential("),
}


def _variant(tmp_path, edits) -> Path:
    text = SOLUTION
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "09_memory.py"
    path.write_text(text)
    return path


def _failed(result) -> dict:
    return {next(k for k, v in CHECK.items() if v in c.name): c.message for c in result.checks if not c.ok}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_loses_its_checks(mistake, tmp_path):
    edits, must_fail, phrase = MISTAKES[mistake]
    failed = _failed(core.grade("09", path=_variant(tmp_path, edits)))
    assert set(failed) == must_fail, failed
    for m in failed.values():
        assert phrase in m and "not implemented" not in m and "forbids" not in m, m


@pytest.mark.parametrize("how", list(USES_TORCH))
def test_torch_checkpoint_scores_0_naming_the_rule_and_line(how, tmp_path):
    edits, call = USES_TORCH[how]
    path = _variant(tmp_path, edits)
    line = next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if call in ln)
    r = core.grade("09", path=path)
    assert r.points == 0, [c.name for c in r.checks if c.ok]
    name = "checkpoint_sequential" if how == "checkpoint_sequential" else "checkpoint"
    for c in r.checks:
        assert f"torch.utils.checkpoint.{name} was called at" in c.message, c.message
        assert f"{path.name}:{line}, which this exercise forbids" in c.message, c.message

