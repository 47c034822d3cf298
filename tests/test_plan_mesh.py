"""Chapter 11's planner (minidist/compose/plan_mesh.py): its choice equals a search of every
configuration that weighs every pipeline stage, for every pipeline schedule (the appendix,
section G); its memory and price are the course's formulas (chapters 08-11) on one rank of the
mesh, each schedule's held and timed as its order holds and times it; its command line says
what to change."""

import itertools

import pytest

from minidist.compose import plan_mesh as PM
from minidist.run import plan as R  # the planners' command line
from minidist.cost_model import Hardware, block_activation_bytes, rank_params, step_time
from minidist.cost_model import ELEM, GB
from minidist.memory import step_memory
from minidist.model import PRESETS, GPTConfig, config_num_params
from minidist import pipeline as pl
from minidist.model import flops_per_token
from minidist.memory.estimate import output_grad_bytes
from minidist.pipeline import chunk_layers, orders, split_layers
from minidist.pipeline import measure as pm
from minidist.pipeline.measure import stage_activation_bytes
from minidist.memory.plan import PlanError
from minidist.tensor_parallel.cost import param_bytes, tp_block_activation_bytes


def _brute_force(cfg, batch, T, world, budget_gb, precision="bf16", mesh=None):
    """Every (tp, pp, ZeRO, recomputation, sp, m) that train_gpt's rules allow, written out
    here, each stage of its pipeline weighed: the cheapest that fits (its price tuple).
    A configuration's memory is weighed only if its price could win (the answer is the same).
    `mesh`: (tp, pp, sp) fixed, as train_gpt's command line fixes them."""
    L, best = cfg.n_layer, None
    for tp, pp in itertools.product(range(1, world + 1), repeat=2):
        if world % (tp * pp) or cfg.n_head % tp or pp > L:
            continue
        dp = world // (tp * pp)
        for zero, ck, sp, m in itertools.product(range(4), (False, True), (False, True), range(1, batch + 1)):
            if (batch // dp) % m or (pp > 1 and zero > 1) or (tp > 1 and zero == 3) or (sp and (tp == 1 or T % tp)):
                continue
            if mesh is not None and (tp, pp, sp) != mesh:
                continue
            step_s, sent = PM.price(cfg, batch, T, dp, tp, pp, zero, m, ck, sp, precision)
            key = (step_s, (pp - 1) / (m + pp - 1), sum(sent), ck, sp, m, zero, pp, tp, 1)
            if best is not None and key >= best:
                continue
            peak = max(step_memory(cfg, batch // (dp * m), T, dp, zero, ck, precision, tp=tp, sequence_parallel=sp,
                                   blocks=L // pp + (s < L % pp), first=s == 0, last=s == pp - 1,
                                   in_flight=min(pp - s, m))["peak"] for s in range(pp))
            if peak <= budget_gb * GB:
                best = key
    for cp in range(2, world + 1) if mesh is None else ():  # chapter 12: dp x cp, zigzag's 2 cp chunks
        if world % cp or T % (2 * cp):
            continue
        dp = world // cp
        for zero, ck, m in itertools.product(range(3), (False, True), range(1, batch + 1)):
            if (batch // dp) % m:
                continue
            step_s, dp_bytes, ring = PM.cp_price(cfg, batch, T, dp, cp, zero, m, ck, precision)
            key = (step_s, 0.0, dp_bytes + ring, ck, False, m, zero, 1, 1, cp)
            B = batch // (dp * m)  # every weight; T/cp tokens' activations; the ring's two K, V blocks
            peak = step_memory(cfg, B, T // cp, dp * cp, zero, ck, precision)["peak"] + 4 * B * (T // cp) * cfg.n_embd * ELEM[precision]
            if (best is None or key < best) and peak <= budget_gb * GB:
                best = key
    return best


# (preset, sequence length, sequences per rank, budgets in GB): budgets from "nothing fits"
# to "plain data parallelism fits", so that every axis, ZeRO stage and switch gets chosen
GRID = [("gpt2", 1024, 4, (1, 3), range(1, 17)),
        ("gpt3-1.3b", 1024, 2, (8, 24), range(1, 17)),
        ("gpt2-medium", 1024, 2, (2, 6), (3, 6, 12, 16)),
        ("small", 256, 8, (0.05, 0.2), (2, 4, 8, 12)),
        ("gpt3-6.7b", 1024, 1, (20, 80), (4, 8, 16)),
        ("gpt2", 65536, 1, (8, 80), (4, 8))]  # chapter 12: a long sequence, where cp pays
CASES = [(name, T, per * w, w, b) for name, T, per, budgets, worlds in GRID for w in worlds for b in budgets]


@pytest.mark.parametrize("name, T, batch, world, budget", CASES)
def test_plan_equals_brute_force(name, T, batch, world, budget):
    cfg = GPTConfig(**{**PRESETS[name], "block_size": T})
    want = _brute_force(cfg, batch, T, world, budget)
    if want is None:
        with pytest.raises(PlanError, match="nothing fits"):
            PM.plan_mesh(cfg, batch, T, world, budget)
        return
    got, line = PM.plan_mesh(cfg, batch, T, world, budget)
    assert got.price() == want
    assert got.peak <= budget * GB and f"of {budget:g} GB per rank" in line and "GB sent per rank per step" in line


@pytest.mark.parametrize("name, T, per, world, budget", [("gpt2", 1024, 4, 8, 3), ("gpt3-1.3b", 1024, 2, 16, 8),
                                                        ("small", 256, 8, 8, 0.05), ("gpt2-medium", 1024, 2, 12, 2)])
def test_plan_on_a_given_mesh_equals_brute_force_on_it(name, T, per, world, budget):
    """train_gpt's auto flags with --tp/--pp: the mesh (and sequence parallelism) is the
    command line's; the ZeRO stage, micro-batches and recomputation are planned on it."""
    cfg, batch = GPTConfig(**PRESETS[name]), per * world
    for dp, tp, pp in PM.meshes(cfg, world):
        for sp in (False, True) if tp > 1 and T % tp == 0 else (False,):
            want = _brute_force(cfg, batch, T, world, budget, mesh=(tp, pp, sp))
            if want is None:
                with pytest.raises(PlanError, match=f"nothing fits {budget:g} GB per rank on dp {dp} x tp {tp} x pp {pp}"):
                    PM.plan_on_mesh(cfg, batch, T, dp, tp, pp, budget, sp=sp)
                continue
            got, line = PM.plan_on_mesh(cfg, batch, T, dp, tp, pp, budget, sp=sp)
            assert (got.dp, got.tp, got.pp, got.sequence_parallel) == (dp, tp, pp, sp)
            assert got.price() == want and got.peak <= budget * GB and "GB sent per rank per step" in line


# Cases of the grid where the plan uses each axis, stage and switch (or nothing fits), so
# that the comparison above means something
SHOWCASE = [("gpt3-1.3b", 1024, 2, 1, 8), ("gpt2", 1024, 44, 11, 3), ("gpt3-1.3b", 1024, 2, 1, 24),
            ("gpt3-1.3b", 1024, 8, 4, 8), ("gpt2", 1024, 12, 3, 1), ("gpt3-1.3b", 1024, 20, 10, 8),
            ("gpt2-medium", 1024, 12, 6, 2), ("gpt2-medium", 1024, 6, 3, 6), ("gpt2", 65536, 8, 8, 8)]


def test_the_grid_chooses_every_axis():
    seen = set()
    for name, T, batch, world, budget in SHOWCASE:
        assert (name, T, batch, world, budget) in CASES
        try:
            c = PM.plan_mesh(GPTConfig(**{**PRESETS[name], "block_size": T}), batch, T, world, budget)[0]
        except PlanError:
            seen.add("none")
            continue
        seen |= {f"zero{c.zero}"} | {k for k, on in (("tp", c.tp > 1 and c.pp == 1), ("pp", c.pp > 1 and c.tp == 1),
                                                      ("tp+pp", c.tp > 1 and c.pp > 1), ("rc", c.checkpointed),
                                                      ("sp", c.sequence_parallel), ("cp", c.cp > 1)) if on}
    assert seen == {"none", "zero0", "zero1", "zero2", "zero3", "tp", "pp", "tp+pp", "rc", "sp", "cp"}, seen


def test_a_long_sequence_that_fits_nowhere_else_gets_cp_and_the_reason():
    """gpt2 with 65,536-token sequences on 8 ranks of 8 GB: no dp x tp x pp plan fits (tp's
    sequence parallelism leaves attention's input whole), dp 1 x cp 8 does, and says why."""
    cfg = GPTConfig(**{**PRESETS["gpt2"], "block_size": 65536})
    with pytest.raises(PlanError, match="nothing fits 8 GB per rank on 8 ranks"):
        PM.plan_mesh(cfg, 8, 65536, 8, 8, context_parallel=False)
    c, line = PM.plan_mesh(cfg, 8, 65536, 8, 8)
    assert (c.dp, c.cp) == (1, 8) and c.peak <= 8 * GB
    assert c.peak == PM.cp_memory(cfg, 8, 65536, 1, 8, c.zero, c.micro, c.checkpointed)
    assert line.startswith("dp 1 x cp 8, ZeRO-") and line.endswith(
        "why cp 8: each rank holds 1/8 of every sequence's activations, and without it nothing fits 8 GB per rank")


PRESET_CFGS = [GPTConfig(**PRESETS[n]) for n in ("tiny", "gpt2", "gpt2-xl", "gpt3-1.3b")]


@pytest.mark.parametrize("cfg", PRESET_CFGS, ids=lambda c: f"L{c.n_layer}d{c.n_embd}")
def test_rank_memory_is_chapters_10_and_11s(cfg):
    """The pieces step_memory adds for a mesh are the formulas counted against real runs:
    chapter 10's parameters and fp32 activations per tp rank, chapter 11's per stage."""
    d, H, B, T = cfg.n_embd, cfg.n_head, 2, 64
    for tp in (t for t in (1, 2, 4, 5, 8) if H % t == 0):
        assert 4 * rank_params(cfg, tp) == param_bytes(cfg, tp, 0)
        for sp in (False, True):
            ours = block_activation_bytes(B, T, d, H, "fp32", False, tp, sp)
            assert ours == tp_block_activation_bytes(B, T, d, H, tp, sp)
    assert rank_params(cfg) == config_num_params(cfg)
    for pp in (2, 3, 4):
        cuts = [len(r) for r in split_layers(cfg.n_layer, pp)]
        stages = [rank_params(cfg, 1, n, s == 0, s == pp - 1) for s, n in enumerate(cuts)]
        assert sum(stages) == config_num_params(cfg) + cfg.vocab_size * d  # the tied copy, twice
        for s, n in enumerate(cuts):
            for m in (1, 2, 8):
                held = min(pp - s, m)
                got = step_memory(cfg, B, T, 1, 0, blocks=n, first=s == 0, last=s == pp - 1, in_flight=held)
                # chapter 11's count, exact, less the loss's one 4-byte total weight
                want = held * (stage_activation_bytes(cfg, B, T, n, s == 0, s == pp - 1) - 4 * (s == pp - 1))
                assert got["activations"] == want


def test_data_parallel_price_is_chapter_08s():
    """Without tp and pp, one micro-batch: the planner's step time is cost_model.step_time's
    (fp32 gradients on the wire, as minidist sends them), and so are its bytes."""
    cfg, hw = GPTConfig(**PRESETS["gpt2"]), Hardware()
    for n, zero, B in itertools.product((2, 8, 16), range(4), (1, 8)):
        step_s, sent = PM.price(cfg, n * B, 1024, n, 1, 1, zero, 1, False, False)
        want = step_time(cfg, ("dp", "zero1", "zero2", "zero3")[zero], n, hw, B, 1024, elem_bytes=4)
        assert step_s == pytest.approx(want["step_s"], rel=1e-12)
        assert sent[0] == pytest.approx(want["bytes_sent"], rel=1e-12) and sent[1:] == (0, 0)


def test_memory_falls_with_micro_batches_once_the_pipe_is_full():
    """What the search relies on: from m = p on, more micro-batches never need more memory
    (every stage keeps p - s in flight, each smaller); and no middle stage needs more than
    the first."""
    cfg = GPTConfig(**PRESETS["gpt2"])
    for pp, tp, ck, sp in itertools.product((1, 2, 3, 4, 6), (1, 2), (False, True), (False, True)):
        ms = (1, 2, 3, 4, 6, 8, 12, 24, 48, 96)
        steady = [PM.peak_memory(cfg, 96, 1024, 1, tp, pp, 0, m, ck, sp and tp > 1) for m in ms if m >= pp]
        assert steady == sorted(steady, reverse=True)
        for m in (1, 4, 12):
            ends = PM.peak_memory(cfg, 96, 1024, 1, tp, pp, 0, m, ck, sp and tp > 1)
            assert all(PM.stage_memory(cfg, 96, 1024, 1, tp, pp, 0, m, ck, sp and tp > 1, s) <= ends for s in range(pp))


def test_more_memory_never_slower():
    cfg = GPTConfig(**PRESETS["gpt3-1.3b"])
    times = [PM.plan_mesh(cfg, 32, 1024, 16, b)[0].step_s for b in (6, 10, 20, 40, 80)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_nothing_fits_says_what_to_change():
    with pytest.raises(PlanError) as e:
        PM.plan_mesh(GPTConfig(**PRESETS["gpt3-6.7b"]), 2, 1024, 2, 20)
    assert "nothing fits 20 GB per rank on 2 ranks" in str(e.value) and "needs" in str(e.value)
    assert "use more ranks" in str(e.value)


def test_cli_prints_the_choice_and_a_table(capsys):
    R.main(["mesh", "--preset", "gpt2", "--world-size", "8", "--budget-gb", "80"])
    out = capsys.readouterr().out
    assert "plan: dp " in out and "ms a step modelled" in out
    assert out.count(" x pp ") >= 1 + len(PM.meshes(GPTConfig(**PRESETS["gpt2"]), 8))  # the plan + one row per shape


@pytest.mark.parametrize("argv, says", [
    (["--world-size", "0"], "argument --world-size: must be an integer from 1 to 16,777,216"),
    (["--world-size", "999999999999"], "argument --world-size: must be an integer from 1 to 16,777,216"),
    (["--world-size", "two"], "argument --world-size: invalid int value"),
    (["--budget-gb", "-80"], "argument --budget-gb: must be a finite number > 0"),
    (["--budget-gb", "nan"], "argument --budget-gb: must be a finite number > 0"),
    (["--batch-size", "0"], "argument --batch-size: must be an integer from 1"),
    (["--batch-size", "12", "--world-size", "8"], "does not divide over 8 ranks: use a multiple of 8"),
    (["--preset", "gpt5"], "unknown model 'gpt5'"),
])
def test_bad_arguments_say_what_to_change(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        R.main(["mesh", *argv])
    captured = capsys.readouterr()
    assert e.value.code == 2 and says in captured.err and not captured.out, captured.err


# Chapter 11's appendix, section G: train_gpt's --pp-schedule on a mesh given, budgets where
# memory binds (GPipe's m in flight fits nothing on some; ZB-H1's last stage holds p heads)
SCHEDULED = [("gpt2", 4, 8, 3, 1, 2), ("gpt2", 8, 8, 2, 1, 4), ("gpt2-medium", 4, 8, 6, 2, 2), ("gpt2", 8, 8, 1.5, 2, 4)]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1)]


@pytest.mark.parametrize("name, per, world, budget, tp, pp", SCHEDULED)
def test_plan_on_a_mesh_for_each_schedule_equals_brute_force(name, per, world, budget, tp, pp):
    """plan_on_mesh(schedule=...) is the cheapest of every (ZeRO, recomputation, m) written out
    here, every stage weighed as the schedule holds it: GPipe m in flight, 1F1B p - s,
    interleaved its (chunk, micro-batch) forwards over its chunks' blocks (m in groups of pp),
    ZB-H1 p with s + 1 pending W's (no recomputation); each priced by its ideal step."""
    cfg, T, batch = GPTConfig(**PRESETS[name]), 1024, per * world
    dp, L = world // (tp * pp), cfg.n_layer
    for sched, v in SCHEDULES:
        blocks = [sum(len(c) for c in chunk_layers(L, pp, v)[s::pp]) for s in range(pp)] if v > 1 else \
            [len(r) for r in split_layers(L, pp)]
        best = None
        for zero, ck, m in itertools.product((0, 1), (False, True), range(1, batch // dp + 1)):
            if (batch // dp) % m or (v > 1 and m % pp) or (sched == "zb-h1" and ck):
                continue
            step_s, sent = PM.price(cfg, batch, T, dp, tp, pp, zero, m, ck, False, schedule=sched, v=v)
            key = (step_s, pm.schedule_bubble(sched, pp, m, v), sum(sent), ck, False, m, zero, pp, tp, 1)
            if best is not None and key >= best:
                continue
            peak = max(step_memory(cfg, batch // (dp * m), T, dp, zero, ck, "bf16", tp=tp, blocks=blocks[s],
                                   first=s == 0, last=s == pp - 1, in_flight=pm.in_flight_formula(sched, pp, s, m, v),
                                   chunks=v, pending_w=min(s + 1, m) if sched == "zb-h1" else 0)["peak"]
                       for s in range(pp))
            if peak <= budget * GB:
                best = key
        if best is None:
            with pytest.raises(PlanError, match=f"nothing fits {budget:g} GB per rank"):
                PM.plan_on_mesh(cfg, batch, T, dp, tp, pp, budget, schedule=sched, virtual_stages=v)
            continue
        got, line = PM.plan_on_mesh(cfg, batch, T, dp, tp, pp, budget, schedule=sched, virtual_stages=v)
        assert got.price() == best and (got.schedule, got.v) == (sched, v), sched
        assert PM.NAMES[sched] in line and got.peak <= budget * GB


def test_each_schedule_is_priced_by_its_ideal_step_and_its_messages():
    """With messages free, a step costs step_units micro-batches' compute (the ideal timeline's
    span, tests/test_pipeline_schedules.py); the pp bytes are the messages the schedule's slots
    post (minidist.pipeline.orders.talks), m (2 v - 1) at either end of a pipe of 2."""
    cfg, free = GPTConfig(**PRESETS["gpt2"]), Hardware(intra_alpha_s=0.0, inter_alpha_s=0.0, intra_GBps=1e30,
                                                        inter_GBps=1e30)
    B, T = 2, 1024
    for p, m in ((2, 4), (4, 8)):
        compute = flops_per_token(cfg, T) * B * T / p / (free.peak_flops * free.mfu)
        for sched, v in SCHEDULES:
            step_s, sent = PM.price(cfg, B * m, T, 1, 1, p, 0, m, False, False, hw=free, schedule=sched, v=v)
            assert step_s == pytest.approx(compute * pm.step_units(sched, p, m, v), rel=1e-9), (sched, v)
            if sched in ("interleaved", "zb-h1"):
                for s in range(p):
                    posted = sum(len(sends) for sends, _ in orders.talks(pl.SLOTS[sched](p, v, m, s), p, p * v))
                    assert posted == m * (2 * v - (s == 0) - (s == p - 1)), (sched, v, s)
                if p == 2:
                    assert sent[2] == m * (2 * v - 1) * 4 * B * T * cfg.n_embd


def test_interleaved_and_zb_h1_memory_is_their_held_activations():
    """step_memory for a rank of chunks holds exactly what interleaved 1F1B's order holds at its
    peak (chapter 09's bytes per chunk, walked), but on the first rank, where each chunk in flight
    is counted with the token indices (a few bytes a token over); GPipe holds m, ZB-H1 p and its
    pending W's layers' output gradients (fp32)."""
    B, T = 2, 16
    for L, p, v in ((8, 2, 2), (8, 4, 2), (12, 3, 2)):
        cfg, cuts = GPTConfig(n_layer=L, n_head=4, n_embd=32, block_size=T, vocab_size=64), chunk_layers(L, p, v)
        for s in range(p):
            for m in (p, 2 * p):
                per = {c: stage_activation_bytes(cfg, B, T, len(cuts[c * p + s]), c * p + s == 0,
                                                 c * p + s == p * v - 1) - 4 * (c * p + s == p * v - 1)
                       for c in range(v)}
                held, most = set(), 0
                for kind, vs, mb in (a for slot in pl.interleaved_slots(p, v, m, s) for a in slot):
                    (held.add if kind == "F" else held.remove)((vs // p, mb))
                    most = max(most, sum(per[c] for c, _ in held))
                k = pm.in_flight_formula("interleaved", p, s, m, v)
                got = step_memory(cfg, B, T, 1, 0, blocks=sum(map(len, cuts[s::p])), first=s == 0, last=s == p - 1,
                                  in_flight=k, chunks=v)["activations"]
                assert most <= got <= most + (s == 0) * k * (8 * B * T + 8 * T), (L, p, v, s, m)
                assert got == most or s == 0
    cfg = GPTConfig(**PRESETS["gpt2"])
    for s in range(4):
        plain = dict(blocks=3, first=s == 0, last=s == 3)
        assert PM.stage_memory(cfg, 64, 1024, 1, 1, 4, 0, 8, False, False, s, schedule="gpipe") == \
            step_memory(cfg, 8, 1024, 1, 0, False, "bf16", in_flight=8, **plain)["peak"]
        zb = step_memory(cfg, 8, 1024, 1, 0, False, "bf16", in_flight=4, pending_w=s + 1, **plain)
        assert PM.stage_memory(cfg, 64, 1024, 1, 1, 4, 0, 8, False, False, s, schedule="zb-h1") == zb["peak"]
        assert zb["activations"] == step_memory(cfg, 8, 1024, 1, 0, False, "bf16", in_flight=4, **plain)["activations"] \
            + (s + 1) * output_grad_bytes(cfg, 8, 1024, 3, s == 0, s == 3, "bf16")
