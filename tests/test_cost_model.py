"""minidist.cost_model against oracles written out here: chapter 02's ring formulas, the
ZeRO paper's memory formula, Newton-Schulz FLOPs counted matmul by matmul, step times
computed by hand for a network whose alpha and beta are known, and an event-by-event
simulation of the overlap. Then `python -m minidist.bench scale` and `all` end to end (no
training: the other benchmarks are stubs here; tests/test_bench.py runs them)."""

import json
import math

import pytest

from minidist import cost_model as cm
from minidist import memory as M
from minidist.bench import __main__ as cli, collectives, scale
from minidist.model import GPT, PRESETS, GPTConfig, config_num_params, num_params

NS = [1, 2, 3, 4, 7, 8, 9, 16, 64, 1000, 1024]
TINY = GPTConfig(**PRESETS["tiny"], vocab_size=2048)


# chapter 02's ring, written out by hand: bytes each rank sends as a share of S, messages
RING = {"all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
        "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
        "all_gather": (lambda n: (n - 1) / n, lambda n: n - 1)}


def test_collective_formulas_are_the_rings_of_chapter_02():
    for op, (fraction, steps) in RING.items():
        for n in NS:
            assert cm.SENT_FRACTION[op](n) == pytest.approx(fraction(n), abs=1e-15)
            assert cm.MESSAGES["ring"][op](n) == steps(n)
    for op, (fraction, steps) in collectives.RING.items():  # what the benchmark fits with
        want = RING["all_reduce" if op.startswith("all_reduce") else op]
        assert [(fraction(n), steps(n)) for n in NS] == [(want[0](n), want[1](n)) for n in NS]


def test_newton_schulz_flop_count_matches_the_matmuls():
    m, n = 3, 7  # per step: (m x n)(n x m), (m x m)(m x m), (m x m)(m x n): 2mnm + 2mmm + 2mmn
    assert cm.ns_flops(m, n, steps=1) == 2 * m * n * m + 2 * m**3 + 2 * m * m * n
    assert cm.ns_flops(n, m) == cm.ns_flops(m, n)  # a tall matrix is iterated transposed


@pytest.mark.parametrize("strategy", cm.STRATEGIES)
def test_bytes_sent_per_step_are_the_rings_volumes(strategy):
    ar, rs, ag = (RING[op][0] for op in ("all_reduce", "reduce_scatter", "all_gather"))
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=64, block_size=32, vocab_size=101)
    psi = config_num_params(cfg)
    for n in NS:
        S = 2 * psi  # bf16 on the wire
        expected = {"dp": ar(n) * S, "zero1": rs(n) * S + ag(n) * S, "zero2": rs(n) * S + ag(n) * S,
                    "zero3": 2 * ag(n) * S + rs(n) * S}[strategy]  # ZeRO-3: gather twice, scatter once
        assert cm.comm_volume(strategy, psi, n) == pytest.approx(expected, rel=1e-12, abs=1e-9)
        # and the step's own bookkeeping, summed over buckets or layers, says the same
        sent = cm.step_time(cfg, strategy, n, cm.Hardware(), micro_batch=2, bucket_MB=0.01)["bytes_sent"]
        assert sent == pytest.approx(expected, rel=1e-12, abs=1e-9)
        # k micro-steps: DP and ZeRO-1 communicate in the last one only; ZeRO-2 reduce-scatters
        # every micro-step's gradients; ZeRO-3 runs its whole exchange every micro-step
        k = 3
        per_k = {"dp": ar(n) * S, "zero1": rs(n) * S + ag(n) * S, "zero2": k * rs(n) * S + ag(n) * S,
                 "zero3": k * (2 * ag(n) * S + rs(n) * S)}[strategy]
        assert cm.comm_volume(strategy, psi, n, accum=k) == pytest.approx(per_k, rel=1e-12, abs=1e-9)


def test_a_free_network_scales_perfectly():
    free = cm.Hardware(intra_alpha_s=0.0, inter_alpha_s=0.0, intra_GBps=math.inf, inter_GBps=math.inf,
                       overlap=0.0)  # nothing hidden, and still nothing to pay
    for cfg in cm.MODELS.values():
        for n in NS:
            for s in cm.STRATEGIES:
                assert cm.step_time(cfg, s, n, free)["efficiency"] == 1.0


@pytest.mark.parametrize("latency", ["ring", "tree"])
def test_efficiency_never_rises_with_n_and_drops_when_the_ring_leaves_the_node(latency):
    hw = cm.Hardware(latency=latency)
    assert hw.inter_GBps < hw.intra_GBps
    ns = [2 ** k for k in range(11)]
    for cfg in cm.MODELS.values():
        for s in cm.STRATEGIES:
            eff = [cm.step_time(cfg, s, n, hw)["efficiency"] for n in ns]
            assert eff[0] == 1.0
            assert all(b <= a for a, b in zip(eff, eff[1:])), (s, eff)
        dp = {n: cm.step_time(cfg, "dp", n, hw)["exposed_s"] for n in (8, 16)}
        assert dp[16] > 2 * dp[8]  # 50 GB/s between nodes against 450 inside one


def test_zero_memory_is_the_papers_formula():
    for psi in (7.5e9, 124e6, 1e3):
        for n in (1, 2, 8, 64, 1024):
            by_hand = [(2 + 2 + 12) * psi, (2 + 2) * psi + 12 * psi / n,
                       2 * psi + (2 + 12) * psi / n, (2 + 2 + 12) * psi / n]
            fp32_adamw = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
            for stage in range(4):
                assert cm.model_state_bytes(psi, n, stage) == pytest.approx(by_hand[stage], rel=1e-12)
                assert cm.model_state_bytes(psi, n, stage, k=8, p=4, g=4) == pytest.approx(
                    fp32_adamw[stage], rel=1e-12)  # what bench zero compares its runs with
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters on 64 GPUs
    assert [round(cm.model_state_bytes(7.5e9, 64, s) / 1e9, 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]


def test_memory_per_gpu_shrinks_with_stage_and_flags_what_does_not_fit():
    for cfg in cm.MODELS.values():
        for n in (8, 64):
            totals = [cm.memory_per_gpu(cfg, s, n)["total_GB"] for s in cm.STRATEGIES]
            assert all(b < a for a, b in zip(totals, totals[1:]))
    seven_b = cm.memory_per_gpu(cm.MODELS["7B"], "dp", 64)  # 16 bytes x 6.65e9 alone is 106 GB
    assert seven_b["state_GB"] > 80 and not seven_b["fits_80GB"]
    assert cm.memory_per_gpu(cm.MODELS["124M"], "dp", 64)["fits_80GB"]


def test_the_models_at_scale_are_presets():
    """One table of sizes: the cost model's models are minidist.model.PRESETS entries,
    with GPT-2's vocabulary (GPTConfig's default) added, nothing else."""
    assert set(cm.MODELS) == set(cm.SCALE_PRESETS) == {"124M", "350M", "1.3B", "7B"}
    for label, name in cm.SCALE_PRESETS.items():
        assert cm.MODELS[label] == GPTConfig(**PRESETS[name]) and cm.MODELS[label].vocab_size == 50257
    sizes = {label: config_num_params(cfg) / 1e9 for label, cfg in cm.MODELS.items()}
    assert [round(v, 2) for v in sizes.values()] == [0.12, 0.35, 1.31, 6.65]  # the labels say it


@pytest.mark.parametrize("preset", PRESETS)
def test_memory_per_gpu_is_the_memory_models_parts(preset):
    """One memory model: at every size, stage and N, the cost model's memory per GPU is
    minidist.memory.step_memory's model states, activations and ZeRO-3 gathered parameters,
    to the byte, and no more than its peak (which adds backward's transients)."""
    cfg = GPTConfig(**PRESETS[preset])
    for n in (1, 8, 1024):
        for stage, strategy in enumerate(cm.STRATEGIES):
            for ck in (False, True):
                got = cm.memory_per_gpu(cfg, strategy, n, micro_batch=4, checkpointed=ck)
                step = M.step_memory(cfg, 4, cfg.block_size, n, stage, ck, "bf16")
                state = step["params"] + step["grads"] + step["optimizer"]
                act = M.activation_bytes(cfg, 4, cfg.block_size, "bf16", ck)
                gathered = M.zero3_gathered_bytes(cfg) if stage == 3 else 0.0
                assert got["state_GB"] * cm.GB == pytest.approx(state, rel=1e-12)
                assert step["activations"] == act  # step_memory's own, exact, integers
                assert got["activations_GB"] * cm.GB == pytest.approx(act, rel=1e-12)
                assert got["total_GB"] * cm.GB == pytest.approx(state + act + gathered, rel=1e-12)
                assert got["total_GB"] * cm.GB <= step["peak"]


def _simulate(c, k, t, feeds_compute):
    """Event by event, on one link: k transfers of c seconds, k compute slices of t/k.
    feeds_compute (ZeRO-3): slice i needs transfer i, and transfer i+1 may start once
    slice i has started (one prefetch). Otherwise (DP buckets): transfer i needs slice i."""
    f, link, comp_start, comp_end = t / k, 0.0, 0.0, 0.0
    for _ in range(k):
        if feeds_compute:
            link = max(link, comp_start) + c
            comp_start = max(link, comp_end)
            comp_end = comp_start + f
        else:
            comp_end += f
            link = max(link, comp_end) + c
    return (comp_end if feeds_compute else link) - t


@pytest.mark.parametrize("feeds", [True, False])
def test_overlap_formula_matches_an_event_simulation(feeds):
    for c in (0.0, 0.1, 0.5, 1.0, 3.0):
        for k in (1, 2, 5, 12):
            for t in (0.0, 1.0, 10.0):
                assert cm.exposed_time(c, k, t) == pytest.approx(_simulate(c, k, t, feeds), abs=1e-12)


def _known_network():
    """alpha 200 us and 2 GB/s, measured by the benchmark's own fit from exact timings."""
    alpha, beta = 200e-6, 1 / 2e9
    rows = [{"op": op, "world_size": 4, "bytes": S, "ours_s": steps(4) * alpha + f(4) * S * beta}
            for op, (f, steps) in RING.items() for S in (1 << 12, 1 << 20, 1 << 24)]
    return alpha, beta, collectives.fit_alpha_beta(rows)


def test_step_time_from_a_known_network_by_hand():
    alpha, beta, fit = _known_network()
    hw = cm.hardware_from_fit(fit, 4, peak_flops=1e11)  # overlap 0: every byte shows
    psi, (L, T, d) = num_params(GPT(TINY)), (TINY.n_layer, TINY.block_size, TINY.n_embd)
    compute = (6 * (psi - T * d) + 12 * L * T * d) * 2 * T / 1e11  # 2 sequences, fp32 FLOPs by hand
    S = 4 * psi
    dp = cm.step_time(TINY, "dp", 4, hw, micro_batch=2, elem_bytes=4, bucket_MB=100)
    assert dp["step_s"] == pytest.approx(compute + 6 * alpha + 1.5 * S * beta, rel=1e-6)
    z3 = cm.step_time(TINY, "zero3", 4, hw, micro_batch=2, elem_bytes=4)
    one = 3 * alpha + 0.75 * (S / L) * beta  # a gather or a scatter of one block's share
    assert z3["step_s"] == pytest.approx(compute + 3 * L * one, rel=1e-6)
    assert z3["comm_s"] == pytest.approx(3 * L * one, rel=1e-6) and z3["messages"] == 3 * L * 3
    # with overlap and buckets far cheaper than backward, only the last bucket shows
    hw.overlap = 1.0
    k = math.ceil(S / 2**20)
    dp = cm.step_time(TINY, "dp", 4, hw, micro_batch=2, elem_bytes=4, bucket_MB=1)
    assert dp["exposed_s"] == pytest.approx(6 * alpha + 1.5 * (S / k) * beta, rel=1e-6)


def test_comparison_with_this_machine_uses_the_fit(tmp_path):
    alpha, beta, fit = _known_network()
    (tmp_path / "collectives.json").write_text(json.dumps({"alpha_beta": {"2": fit}}))
    step = {"no_comm": 0.3, "bucketed:1:no_overlap": 0.34, "bucketed:1": 0.33}
    (tmp_path / "ddp.json").write_text(json.dumps({"step_s": step}))
    rows = {r["what"]: r for r in scale.compare_with_measured(tmp_path)}
    no_overlap = rows["DDP exposed comm, N=2, no overlap (ms)"]
    S = 4 * config_num_params(TINY)
    k = math.ceil(S / 2**20)
    assert no_overlap["measured"] == pytest.approx(40.0)
    assert no_overlap["model"] == pytest.approx(1e3 * (k * 2 * alpha + S * beta), rel=1e-6)


def test_scale_benchmark_quick(tmp_path, capsys):
    cli.main(["scale", "--quick", "--out", str(tmp_path)])  # the command's entry, in this process
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "scale.json").read_text())
    assert {(x["model"], x["n"], x["strategy"]) for x in result["rows"]} == {
        (m, n, s) for m in ("124M", "7B") for n in (8, 64, 1024) for s in cm.STRATEGIES}
    assert all(0 < x["efficiency"] <= 1 for x in result["rows"])
    assert (tmp_path / "scale.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 7B | 1024 | ZeRO-3 |" in printed


def _stub(name, fail=False):
    def fn(args):
        print(f"{name} printed this")
        if fail:
            raise RuntimeError(f"{name} broke on purpose")
        from matplotlib.figure import Figure
        Figure(figsize=(2, 1)).savefig(f"{args.out}/{name}.png")
        return {"rows": [{"op": name, "ms": 1.5}], "ratio": 0.25}
    return fn


@pytest.mark.parametrize("broken", [None, "ddp"])
def test_all_writes_one_report_and_survives_a_failure(tmp_path, monkeypatch, broken):
    for name in ("collectives", "ddp", "zero", "muon", "checksums"):  # scale is real: it is fast
        monkeypatch.setitem(cli.BENCHMARKS, name, _stub(name, fail=name == broken))
    for name in ("muon_zero", "tp", "pp", "cp", "ep"):  # (their quick runs are tested in tests/test_bench.py)
        monkeypatch.setitem(cli.BENCHMARKS, name, _stub(name))
    argv = ["all", "--quick", "--out", str(tmp_path)]
    if broken:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code not in (0, None)
    else:
        cli.main(argv)
    report = (tmp_path / "report.md").read_text()
    for name in ("collectives", "ddp", "zero", "muon", "checksums", "scale"):
        assert f"## {name}" in report
        assert (f"![{name}]({name}.png)" in report) == (name != broken)
        assert (tmp_path / f"{name}.json").exists() == (name != broken)
    assert "| zero | 1.5 |" in report and "| ratio | 0.25 |" in report  # a stub's result as tables
    assert "| 7B | 1024 | ZeRO-3 |" in report  # scale's own markdown table
    assert "muon printed this" in report and "torch" in report and "cpus" in report
    assert ("ddp broke on purpose" in report) == (broken == "ddp")
    assert (tmp_path / "all.png").read_bytes()[:4] == b"\x89PNG"
