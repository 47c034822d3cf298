"""Exercise 01's grader: building a model (or calling minidist's count) scores 0 on the checks
that do it, naming the rule and the line, and each classic slip loses the checks of its
function. (tests/test_exercises.py grades the stubs, the reference and tests/solutions.)"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from exercises.grader import core
from minidist.model import GPT, config_num_params

_spec = importlib.util.spec_from_file_location(
    "solution_01", Path(__file__).parent / "solutions" / "01_gpt.py")
sol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sol)
RIGHT = dict(count_params=sol.count_params, flops_per_token=sol.flops_per_token, mfu=sol.mfu)


def _pos(c):
    return c.block_size * c.n_embd


def count_by_building(cfg):
    with torch.device("meta"):
        model = GPT(cfg)  # the forbidden call
    return sum(p.numel() for p in model.parameters())


def flops_from_minidists_count(cfg, T):
    return 6 * (config_num_params(cfg) - _pos(cfg)) + 12 * cfg.n_layer * T * cfg.n_embd


def _line(fn, text):
    """'tests/test_exercise_01.py:N', N the line of `text` in function `fn`."""
    lines, first = inspect.getsourcelines(fn)
    n = first + next(i for i, ln in enumerate(lines) if text in ln)
    return f"test_exercise_01.py:{n}"


# name: overrides; some check of that function must fail, and no other
MISTAKES = {
    "head counted twice": dict(count_params=lambda c: sol.count_params(c) + c.vocab_size * c.n_embd),
    "position table forgotten": dict(count_params=lambda c: sol.count_params(c) - _pos(c)),
    "LayerNorm bias without bias": dict(count_params=lambda c: sol.count_params(c)
                                        + (0 if c.bias else (2 * c.n_layer + 1) * c.n_embd)),
    "position table in N": dict(flops_per_token=lambda c, T: sol.flops_per_token(c, T) + 6 * _pos(c)),
    "attention left out": dict(flops_per_token=lambda c, T: 6 * (sol.count_params(c) - _pos(c))),
    "block_size for seq_len": dict(flops_per_token=lambda c, T: sol.flops_per_token(c, c.block_size)),
    "forward only (2N)": dict(flops_per_token=lambda c, T: sol.flops_per_token(c, T)
                              - 4 * (sol.count_params(c) - _pos(c))),
    "peak of one device": dict(mfu=lambda f, tps, peak, n=1: f * tps / peak if peak else None),
    "0 for an unknown peak": dict(mfu=lambda f, tps, peak, n=1: f * tps / (peak * n) if peak else 0.0),
}


def _failed(overrides):
    r = core.grade("01", overrides={**RIGHT, **overrides})
    return {c.name: c.message for c in r.checks if not c.ok}


def _checks_of(fn_name):
    return {c.name for c in core.checks_of("01") if c.name.startswith(fn_name)}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_slip_loses_the_checks_of_its_function(mistake):
    (fn_name,) = MISTAKES[mistake]
    failed = _failed(MISTAKES[mistake])
    assert failed and set(failed) <= _checks_of(fn_name), failed
    for msg in failed.values():
        assert "got " in msg and "not implemented" not in msg, msg


def test_building_the_model_scores_0_on_the_checks_that_do_it_naming_the_line():
    failed = _failed(dict(count_params=count_by_building))
    assert set(failed) == _checks_of("count_params"), failed
    for msg in failed.values():
        assert "minidist.model.GPT was called at" in msg and "build no model" in msg, msg
        assert _line(count_by_building, "GPT(cfg)") in msg, msg


def test_calling_minidists_count_scores_0_on_the_checks_that_do_it():
    failed = _failed(dict(flops_per_token=flops_from_minidists_count))
    assert set(failed) == _checks_of("flops_per_token"), failed
    for msg in failed.values():
        assert "minidist.model.config_num_params was called at" in msg, msg
        assert _line(flops_from_minidists_count, "config_num_params(cfg)") in msg, msg
