"""minidist.bench's benchmarks run end to end and write what they promise. Speed is not
asserted here (timed tests on a shared 2-core machine would be noise): the benchmark reports
ratios, and the alpha-beta fit is checked against data whose alpha and beta are known."""

import json
import os
from pathlib import Path

import pytest
import sys

from minidist import cost_model as cm
from minidist.bench import collectives, zero
from conftest import run

# The seven benchmarks that start processes, each as a user runs it (--quick); the tests
# below read their outputs
QUICK = {"collectives": [], "muon": ["--world-sizes", "2"], "zero": ["--world-sizes", "2"],
         "tp": ["--world-sizes", "2"], "pp": [], "cp": [], "ep": []}


# One process runs the six short ones in a row, through the command's own entry
# (minidist.bench.__main__.main, with the arguments a user types): each separate process
# would spend seconds importing torch and matplotlib and starting its fork server first.
_IN_A_ROW = """
import contextlib, io, json, sys, traceback
from minidist.bench.__main__ import main
for name, argv, log in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported as the benchmark's failure
            traceback.print_exc()
            code = 1
    with open(log, "w") as f:
        json.dump({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}, f)
"""


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """{name: (its outcome: returncode, stdout, stderr; its --out folder)}: the muon
    benchmark, the longest, as a user starts it (`python -m minidist.bench muon --quick`),
    while one other process runs the six others in a row (none of these tests asserts a
    speed)."""
    import concurrent.futures
    from types import SimpleNamespace
    outs = {name: tmp_path_factory.mktemp(name) for name in QUICK}
    rest = [[name, [name, "--quick", *QUICK[name], "--out", str(outs[name])], str(outs[name] / "log.json")]
            for name in ("collectives", "zero", "tp", "pp", "cp", "ep")]

    def alone():
        return run([sys.executable, "-m", "minidist.bench", "muon", "--quick", *QUICK["muon"],
                    "--out", str(outs["muon"])], timeout=600)

    def in_a_row():
        done = run([sys.executable, "-c", _IN_A_ROW, json.dumps(rest)], timeout=600)
        assert done.returncode == 0, done.stderr
        return {name: SimpleNamespace(**json.loads(Path(log).read_text())) for name, _, log in rest}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        muon, others = pool.submit(alone), pool.submit(in_a_row)
        results = {"muon": muon.result(), **others.result()}
    return {name: (r, outs[name]) for name, r in results.items()}


def test_collectives_benchmark_quick(bench):
    r, tmp_path = bench["collectives"]
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "collectives.json").read_text())
    ops = {row["op"] for row in result["rows"]}
    assert ops == {"all_reduce", "all_reduce_pipelined", "reduce_scatter", "all_gather"}
    for row in result["rows"]:
        assert row["ours_s"] > 0 and row["torch_s"] > 0 and row["ratio"] > 0
    assert (tmp_path / "collectives.png").read_bytes()[:4] == b"\x89PNG"
    assert "alpha-beta fit, N=2" in r.stdout


def test_alpha_beta_fit_recovers_a_known_model():
    alpha, beta = 50e-6, 1 / 2e9  # 50 us per message, 2 GB/s
    rows = []
    for op, (f, steps) in collectives.RING.items():
        for n in (2, 4):
            for S in (1 << 10, 1 << 16, 1 << 22):
                rows.append({"op": op, "world_size": n, "bytes": S,
                             "ours_s": steps(n) * alpha + f(n) * S * beta})
    fit = collectives.fit_alpha_beta(rows)
    assert abs(fit["alpha_s"] - alpha) / alpha < 1e-6
    assert abs(fit["bandwidth_GBps"] - 2.0) < 1e-6


def test_alpha_beta_fit_never_goes_negative():
    """Timings whose straight-line fit would have a negative latency (noise on a loaded
    machine does that): the fit is the best one with alpha = 0, beta = sum(x t) / sum(x x)."""
    rows, xs, ts = [], [], []
    for op, (f, steps) in collectives.RING.items():
        for S in (1 << 10, 1 << 16, 1 << 22):
            t = f(2) * S / 2e9 + (0 if S > 1 << 10 else -1e-6) + 1e-9
            rows.append({"op": op, "world_size": 2, "bytes": S, "ours_s": t})
            xs.append(f(2) * S)
            ts.append(t)
    fit = collectives.fit_alpha_beta(rows)
    beta = sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs)
    assert fit["alpha_s"] == 0.0
    assert abs(fit["beta_s_per_byte"] - beta) / beta < 1e-9


def test_muon_benchmark_quick(bench):
    r, tmp_path = bench["muon"]
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "muon.json").read_text())
    assert all(row["ours_bf16_s"] > 0 and row["torch_bf16_s"] > 0 for row in result["newton_schulz"])
    assert set(result["distributed_step_s"]) == {"1", "2"}
    assert 0 < result["step_vs_train"]["flop_fraction"] < 1
    runs = result["curves"]["runs"]
    assert {r["optimizer"] for r in runs.values()} == {"adamw", "muon"}
    assert all(len(r["curve"]) >= 2 for r in runs.values())
    assert (tmp_path / "muon.png").read_bytes()[:4] == b"\x89PNG"


def test_zero_benchmark_quick(bench):
    r, tmp_path = bench["zero"]
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "zero.json").read_text())
    run2 = result["runs"]["2"]
    for name, mem in run2["memory"].items():  # measured tensor bytes vs the paper's formula
        held = mem["params"] + mem["grads"] + mem["optimizer_state"]
        f = cm.model_state_bytes(result["psi"], 2, int(name[5]), k=8, p=4, g=4)  # fp32 AdamW
        assert abs(held / f - 1) < 0.05, (name, held, f)
    assert set(run2["step_s"]) == set(zero.VARIANTS)
    assert (tmp_path / "zero.png").read_bytes()[:4] == b"\x89PNG"


def test_tp_benchmark_quick(bench):
    """Chapter 10's benchmark, quick, 2 ranks: what it counts on the real run (bytes handed
    to collectives, parameter bytes, a block's saved activations) equals the closed forms
    at every layout, and the step times and torch's comparison are there."""
    r, tmp_path = bench["tp"]
    assert r.returncode == 0, r.stderr
    run2 = json.loads((tmp_path / "tp.json").read_text())["runs"]["2"]
    layouts = [k for k in run2 if k.startswith("tp ")]
    assert layouts == ["tp 1", "tp 2", "tp 2 sp"]
    for k in layouts:
        m = run2[k]
        assert m["sent"] == pytest.approx(m["sent_formula"]) and m["params"] == m["params_formula"], k
        assert m["saved"] == m["saved_formula"] and m["step_s"] > 0 and m["predicted"] > 0, k
    assert run2["tp 2"]["sent"] > 0 == run2["tp 1"]["sent"]
    assert set(run2["mlp"]) == {"ours", "torch"} and min(run2["mlp"].values()) > 0
    assert (tmp_path / "tp.png").read_bytes()[:4] == b"\x89PNG"


def test_checksums_benchmark_quick():
    """The cost of checkpoint checksums, quick: train_gpt's CPU model saved, loaded and
    verified with and without the CRC-32s, and the real checksum function put back."""
    import argparse

    from minidist.checkpoint import io as checkpoint_io
    from minidist.bench import checksums
    real = checkpoint_io.checksum
    result = checksums.run(argparse.Namespace(quick=True))
    assert checkpoint_io.checksum is real  # put back after the run
    (row,) = result["rows"]
    assert row["preset"] == "tiny" and 1 < row["params_M"] < 1.2 and row["MB"] > 0
    for k in ("save", "load"):
        assert row[f"{k}_with_s"] > 0 and row[f"{k}_without_s"] > 0


def test_pp_benchmark_quick(bench):
    """Chapter 11's benchmark, quick (p 2, m 1, 2, 4; GPipe, 1F1B and ZB-H1, and interleaved 1F1B
    at m 2 and 4, its groups of p): what it counts on the real run equals the formulas
    ((chunk,) micro-batches in flight per stage: m for GPipe, min(p - stage, m) for 1F1B,
    min(p, m) for ZB-H1, interleaved's warm-up plus one; the bytes saved for backward, per
    forward and at the peak, walked by hand here); the bubble it measures is a share of the
    step; its formula column is the ideal timeline's ((p-1)/(m+p-1) for GPipe and 1F1B); a
    point is flagged shared by its own rule. No time is asserted."""
    from minidist.pipeline.measure import in_flight_formula, schedule_bubble
    r, tmp_path = bench["pp"]
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "pp.json").read_text())
    points = result["points"]
    assert {(pt["p"], pt["m"], pt["schedule"]) for pt in points} == \
        {(2, m, s) for m in (1, 2, 4) for s in ("gpipe", "1f1b", "zb-h1")} | {(2, 2, "interleaved"), (2, 4, "interleaved")}
    for pt in points:
        p, m, v = pt["p"], pt["m"], 2 if pt["schedule"] == "interleaved" else 1
        assert pt["formula"] == pytest.approx(schedule_bubble(pt["schedule"], p, m, v))
        if pt["schedule"] in ("gpipe", "1f1b"):
            assert pt["formula"] == pytest.approx((p - 1) / (m + p - 1))
        assert 0 < pt["bubble"] < 1 and pt["ratio"] == pytest.approx(pt["bubble"] / pt["formula"])
        assert pt["shared"] == (pt["cpu_share"] < min(1 - pt["bubble"], result["cores"] / p) - 0.1)
        assert [st["stage"] for st in pt["stages"]] == list(range(p))
        for st in pt["stages"]:
            k = {"gpipe": m, "1f1b": min(p - st["stage"], m), "zb-h1": min(p, m),
                 "interleaved": min((v - 1) * p + 2 * (p - 1 - st["stage"]) + 1, v * m)}[pt["schedule"]]
            assert k == in_flight_formula(pt["schedule"], p, st["stage"], m, v)
            assert st["peak_in_flight"] == st["in_flight_order"] == st["in_flight_formula"] == k
            assert st["saved_per_mb"] == st["saved_per_mb_formula"] and len(st["saved_per_mb"]) == v * m
            assert min(st["saved_per_mb"]) > 0 and st["peak_saved"] == st["peak_saved_formula"]
            if v == 1:  # one size per micro-batch: the peak is k of them
                assert st["peak_saved"] == k * st["saved_per_mb"][0]
            else:  # chunks of one block each (4 blocks in 4 chunks): the first stage's chunk 0 has the lookups
                assert st["peak_saved"] <= k * max(st["saved_per_mb"]) and len(set(st["saved_per_mb"])) == 2
    assert result["memory_counts_equal_formulas"] is True
    # torch.distributed.pipelining's schedules on the same stages: the same gradients, exactly
    # (the same modules and arithmetic; only who calls them differs), and both timed
    assert {(r["schedule"], r["m"]) for r in result["versus_torch"]} == {("gpipe", 2), ("1f1b", 2)}
    for r in result["versus_torch"]:
        assert r["max_grad_diff"] <= 1e-6 and r["ours_s"] > 0 and r["torch_s"] > 0
    assert (tmp_path / "pp.png").read_bytes()[:4] == b"\x89PNG"


def test_cp_benchmark_quick(bench):
    """Chapter 12's benchmark, quick (cp 1 and 2, one causal attention): every way's output
    and gradients equal SDPA's on the whole sequence (fp32), and what it counts on the real
    run equals the closed forms computed here: the bytes each rank sent, the ring's work per
    rank (zigzag even, contiguous not); the forward's measured peak holds at least the K, V
    the formula says, and for the ring and the all-gather it falls from cp 1 to cp 2."""
    from minidist.context_parallel import attention_bytes, attention_memory, imbalance, ring_work
    r, tmp_path = bench["cp"]
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "cp.json").read_text())
    B, H, T, D = (result["size"][k] for k in "BHTD")
    rows = {(row["cp"], row["way"]): row for row in result["rows"]}
    ways = {"ring contiguous": ("ring", "contiguous"), "ring zigzag": ("ring", "zigzag"),
            "allgather zigzag": ("allgather", "zigzag"), "ulysses": ("ulysses", "contiguous")}
    assert set(rows) == {(n, w) for n in (1, 2) for w in ways}
    for (n, name), row in rows.items():
        way, layout = ways[name]
        assert row["max_err"] <= 1e-5, (n, name, row["max_err"])  # fp32, blockwise sums reordered
        sent = attention_bytes(way, B, H, T, D, n)
        assert row["sent_forward"] == [sent["forward"]] * n and row["sent_backward"] == [sent["backward"]] * n
        assert min(row["peak"]) >= attention_memory(way, B, H, T, D, n, layout=layout)["kv"], (n, name)
        assert row["step_s"] > 0 and row["vs_sdpa"] > 0
        if way == "ring":
            assert row["work"] == [ring_work(T, n, rank, layout) for rank in range(n)], (n, name)
    assert sent["forward"] > 0  # (cp 2 sends; cp 1 sends nothing, as its formula says)
    zigzag, contiguous = rows[2, "ring zigzag"]["imbalance"], rows[2, "ring contiguous"]["imbalance"]
    assert zigzag == 1.0 < contiguous == pytest.approx(imbalance(T, 2, "contiguous"))
    for name in ("ring contiguous", "ring zigzag", "allgather zigzag"):
        assert max(rows[2, name]["peak"]) < rows[1, name]["peak"][0], name
    assert {row["fastest"] for row in result["at_scale"]} <= {"ring_contiguous", "ring_zigzag", "allgather", "ulysses"}
    assert (tmp_path / "cp.png").read_bytes()[:4] == b"\x89PNG"


def test_ep_benchmark_quick(bench):
    """Chapter 13's benchmark, quick (ep 2 and 4, one MoE layer, dropless and capacity 1): on
    every rank, what each all-to-all sent (comm.count_bytes) equals ep_model.a2a_bytes of the
    choices one process's routing keeps, computed here, and nothing else was sent; the rows go
    out and come back (what all ranks dispatch, all combine), backward resends both, a capacity
    sends no more than dropless; the output equals one process's. Training: every choice is
    counted, both runs start alike; the drops are never fewer than the pigeonhole's."""
    from minidist.bench import ep_model
    from minidist.experts import capacity
    r, tmp_path = bench["ep"]
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "ep.json").read_text())
    rows, C = result["bytes"], result["layer"]["C"]
    assert {(row["ep"], row["capacity"], row["rank"]) for row in rows} == \
        {(n, f, rank) for n in (2, 4) for f in (0.0, 1.0) for rank in range(n)}
    for row in rows:
        sent = {k: row[k] for k in ("counts", "dispatch", "combine", "backward")}
        assert sent == ep_model.a2a_bytes(row["kept"], C)[row["rank"]] and row["total"] == sum(sent.values())
        assert row["backward"] == row["dispatch"] + row["combine"] > 0 and row["err"] <= 1e-5
    for n in (2, 4):
        mine = {f: [row for row in rows if row["ep"] == n and row["capacity"] == f] for f in (0.0, 1.0)}
        for f, case in mine.items():
            assert sum(row["dispatch"] for row in case) == sum(row["combine"] for row in case)
        assert sum(row["dispatch"] for row in mine[1.0]) <= sum(row["dispatch"] for row in mine[0.0])
    assert result["bytes_equal_formula"] is True and result["outputs_within_tolerance"] is True
    for row in result["step"]:
        assert row["ratio"] > 0 and 1 < row["predicted"] < 1.1  # NVLink: ep costs a few per cent
    assert all(row["vs_one_gpu"] >= 1 and row["over_nvlink"] == (row["ep"] <= 8) for row in result["at_scale"])
    t, training = result["train"], result["training"]
    runs = training["runs"]
    assert [one["aux"] for one in runs] == [t["aux"], 0.0] and runs[0]["start"] == runs[1]["start"]
    for one in runs:  # every choice of every step counted, once
        assert len(one["tokens"]) == t["steps"]
        assert all(sum(layer) == t["batch"] * t["seq"] * t["k"] for step in one["tokens"] for layer in step)
        assert one["start"] == [ep_model.balance(layer) for layer in one["tokens"][0]]
    N = t["val_batch"] * t["seq"]
    for d in training["drops"]:
        slots = capacity(N, t["E"], t["k"], d["capacity"])
        assert d["slots"] == slots and d["fewest"] == (0 if slots is None else max(0, N * t["k"] - t["E"] * slots))
        for one in runs:
            dropped = d[f"aux {one['aux']:g}"]
            assert all(d["fewest"] <= x <= N * t["k"] for x in dropped) and (slots or sum(dropped) == 0)
    assert (tmp_path / "ep.png").read_bytes()[:4] == b"\x89PNG"


def _out_with(name, make):
    """An --out folder (of tmp_path) where `make` put something odd at `name`."""
    def out(tmp_path):
        make(tmp_path / name)
        return str(tmp_path)
    return out


BAD_ARGUMENTS = [  # argv ({file}: a file; a function: of tmp_path), what the one line says
    (["zero", "--quick", "--world-sizes", "0"], "argument --world-sizes: must be an integer >= 1, at most 64"),
    (["zero", "--world-sizes", "1000000"], "argument --world-sizes: must be an integer >= 1, at most 64"),
    (["muon_zero", "--quick", "--world-sizes", "1"], "muon_zero compares ranks: give world sizes >= 2, got 1"),
    (["zero", "--world-sizes", "2", "2"], "argument --world-sizes: 2 given twice"),
    (["zero", "--quick", "--world-sizes", "16"], "zero splits a batch of 8 sequences (--quick) over the ranks"),
    (["tp", "--world-sizes", "3"], "tp splits an MLP of 512 columns over all the ranks: give world sizes that divide"),
    (["ddp", "--world-sizes", "4"], "argument --world-sizes: ddp would ignore it (it runs 2 ranks)"),
    (["cp", "--world-sizes", "4"], "argument --world-sizes: cp would ignore it (it runs its own cp sizes)"),
    (["ep", "--world-sizes", "4"], "argument --world-sizes: ep would ignore it (it runs its own ep sizes)"),
    (["collectives", "--quick", "--world-sizes", "4"], "collectives --quick times 2 ranks only"),
    (["zero", "--ops", "all_gather"], "argument --ops: only collectives times --ops (zero would ignore it)"),
    (["collectives", "--ops", "all_gather", "all_gather"], "argument --ops: all_gather given twice"),
    (["scale", "--quick", "--out", "{file}"], "argument --out: cannot make the folder"),
    (["scale", "--out", ""], "argument --out: is empty: name a folder"),
    # each file a benchmark writes, tried before it runs (it used to fail only at the end)
    (["zero", "--out", _out_with("zero.json", os.mkdir)], "zero.json is a folder, where the benchmark writes a file"),
    (["all", "--quick", "--out", _out_with("report.md", os.mkfifo)], "report.md is a FIFO (named pipe), where"),
    (["muon", "--out", _out_with("muon_runs", Path.touch)], "muon_runs is a file, where the benchmark writes a folder"),
    (["scale", "--out", _out_with("ddp.json", lambda p: p.write_text("[]"))], "ddp.json, which cannot be read (not a"),
]


@pytest.mark.parametrize("argv, says", BAD_ARGUMENTS, ids=[" ".join(a[:1] + [says[:24]]) for a, says in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_before_any_work(argv, says, tmp_path, monkeypatch, capsys):
    from minidist.bench import __main__ as cli
    for name in cli.BENCHMARKS:  # none may start: a refused argument costs nothing
        monkeypatch.setitem(cli.BENCHMARKS, name, lambda args: pytest.fail("the benchmark ran"))
    (tmp_path / "afile").write_text("")
    argv = [a(tmp_path) if callable(a) else a.replace("{file}", str(tmp_path / "afile")) for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and says in lines[-1] and lines[-1].startswith("python -m minidist.bench: error:"), lines
