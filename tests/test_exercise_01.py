"""Exercise 01's rule: the formulas work from the config alone. A count_params that builds
the model (even on the meta device, where it costs nothing) scores 0 on every check that
calls it, with a message naming the rule; the plain formulas score full."""

from __future__ import annotations

import torch

from exercises import grade as G
from minidist.model import GPT


def count_by_building(cfg):
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() counts the tied one once


def plain_count(cfg):
    d, b = cfg.n_embd, int(cfg.bias)
    ln = d + b * d
    block = 2 * ln + (3 * d * d + b * 3 * d) + (d * d + b * d) + (4 * d * d + b * 4 * d) + (4 * d * d + b * d)
    return cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * block + ln


def plain_flops(cfg, seq_len):
    n = plain_count(cfg) - cfg.block_size * cfg.n_embd
    return 6 * n + 12 * cfg.n_layer * seq_len * cfg.n_embd


def plain_mfu(fpt, tokens_per_s, peak_flops, n_devices=1):
    return None if not peak_flops else fpt * tokens_per_s / (peak_flops * n_devices)


def test_01_a_plain_solution_scores_full():
    r = G.grade("01", overrides=dict(count_params=plain_count, flops_per_token=plain_flops,
                                     mfu=plain_mfu))
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


def test_01_building_the_model_scores_0_on_the_checks_that_do_it():
    r = G.grade("01", overrides=dict(count_params=count_by_building, flops_per_token=plain_flops,
                                     mfu=plain_mfu))
    failed = {c.name: c.message for c in r.checks if not c.ok}
    assert {n for n in failed} == {c.name for c in r.checks if "count_params" in c.name}, failed
    for name, msg in failed.items():
        assert "minidist.model.GPT was called, which this exercise forbids" in msg, (name, msg)
        assert "build no model" in msg, (name, msg)
