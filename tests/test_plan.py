"""Chapter 09's planner: its choice equals a search of every configuration, a budget that
nothing fits says what would, and train_gpt's auto flags run what it chose."""

import itertools

import pytest

from minidist.memory import plan as P
from minidist.run import plan as R  # the planners' command line
from minidist.cost_model import MODELS
from minidist.cost_model import GB
from minidist.memory import step_memory
from minidist.model import GPTConfig, config_num_params


def _brute_force(cfg, batch, T, world, budget_gb, precision):
    """Every (stage, micro-steps, recomputation), its memory and its price, written out
    here: the cheapest that fits."""
    psi, share = config_num_params(cfg), batch // world
    fits = []
    for stage, k, ck in itertools.product(range(4), range(1, share + 1), (False, True)):
        if share % k:
            continue
        peak = step_memory(cfg, share // k, T, world, stage, ck, precision)["peak"]
        sends = {0: 2, 1: 2, 2: k + 1, 3: 3 * k}[stage] * psi * (world - 1) / world * 4
        if peak <= budget_gb * GB:
            fits.append(((sends, ck, k, stage), (stage, k, ck)))
    return min(fits)[1] if fits else None


CASES = [(cfg_name, world, per_rank, budget)
         for cfg_name in ("124M", "1.3B") for world in (1, 4, 16) for per_rank in (4, 12)
         for budget in (8, 20, 40, 80)]


@pytest.mark.parametrize("name, world, per_rank, budget", CASES)
def test_plan_equals_brute_force(name, world, per_rank, budget):
    cfg, batch = MODELS[name], per_rank * world
    want = _brute_force(cfg, batch, 1024, world, budget, "bf16")
    if want is None:
        with pytest.raises(P.PlanError, match="nothing fits"):
            P.plan(cfg, batch, 1024, world, budget, "bf16")
        return
    got, line = P.plan(cfg, batch, 1024, world, budget, "bf16")
    assert (got.stage, got.accum, got.checkpointed) == want
    assert got.peak <= budget * GB and f"of {budget:.2f} GB" in line


def test_more_memory_never_costs_more():
    cfg = MODELS["1.3B"]
    prices = [P.plan(cfg, 64, 1024, 8, b, "bf16")[0].price() for b in (30, 40, 60, 80, 140)]
    assert prices == sorted(prices, reverse=True) and prices[0] > prices[-1]


def test_nothing_fits_says_what_would():
    with pytest.raises(P.PlanError) as e:
        P.plan(MODELS["7B"], 8, 1024, 1, 80, "bf16")
    msg = str(e.value)
    assert "nothing fits 80.00 GB" in msg and "ranks would fit it" in msg
    n = int(msg.split("; ")[1].split()[0])
    assert P.plan(MODELS["7B"], 8 * n, 1024, n, 80, "bf16")  # and it does, at that many ranks


def test_plan_cli_prints_the_table(capsys):
    R.main(["memory", "--preset", "gpt2", "--world-size", "8", "--budget-gb", "80"])
    out = capsys.readouterr().out
    assert "plan: ZeRO-" in out and "7B x 1024" in out and "fits" in out


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch-size", "8",
        "--tokenizer", "gpt2-512", "--warmup-steps", "1", "--steps", "2", "--eval-interval", "100",
        "--final-eval-windows", "4", "--sample-tokens", "2", "--device", "cpu"]


def _train(argv):
    from minidist import train_gpt
    s = train_gpt.main(argv)
    keys = ("zero_stage", "grad_accum_steps", "activation_checkpointing")
    return {"args": {k: s["args"][k] for k in keys}, "val_loss": s["val_loss"]}


def test_auto_flags_run_the_planned_configuration(tmp_path, pool):
    from minidist.run.flags import build_parser, resolve_args
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=512)
    # a budget between what 1 micro-step of 4 needs without recomputation and with it,
    # on 2 ranks: the planner has to give something up
    full = step_memory(cfg, 4, 32, 2, 0, False)["peak"] / GB
    argv = TINY + ["--zero-stage", "auto", "--grad-accum-steps", "auto", "--activation-checkpointing",
                   "auto", "--memory-budget-gb", f"{0.99 * full:.6f}", "--out-dir", str(tmp_path)]
    args = resolve_args(build_parser().parse_args(argv), 2)
    choice, line = P.plan(cfg, 8, 32, 2, 0.99 * full)
    assert args.plan == line and (args.zero_stage, args.grad_accum_steps) == (choice.stage, choice.accum)
    assert (choice.stage, choice.accum, choice.checkpointed) != (0, 1, False)
    runs = pool(2).run(_train, argv)
    for s in runs:
        a = s["args"]
        assert (a["zero_stage"], a["grad_accum_steps"]) == (choice.stage, choice.accum)
        assert a["activation_checkpointing"] == ("blocks" if choice.checkpointed else "none")
        assert s["val_loss"] == pytest.approx(runs[0]["val_loss"])


def test_auto_flags_with_a_budget_nothing_fits_fail_before_any_work(capsys):
    from minidist.run.flags import build_parser, resolve_args
    argv = TINY + ["--zero-stage", "auto", "--memory-budget-gb", "1e-6", "--out-dir", "unused"]
    with pytest.raises(SystemExit):
        resolve_args(build_parser().parse_args(argv), 2)
    err = capsys.readouterr().err
    assert "the planner: nothing fits" in err and "needs" in err


@pytest.mark.parametrize("argv, says", [
    (["--world-size", "0"], "argument --world-size: must be an integer >= 1"),
    (["--world-size", "-8"], "argument --world-size: must be an integer >= 1"),
    (["--world-size", "two"], "argument --world-size: must be an integer >= 1"),
    (["--budget-gb", "-80"], "argument --budget-gb: must be a finite number > 0"),
    (["--budget-gb", "nan"], "argument --budget-gb: must be a finite number > 0"),
    (["--budget-gb=-inf"], "argument --budget-gb: must be a finite number > 0"),
    (["--batch-size", "-16"], "argument --batch-size: must be an integer >= 1"),
    (["--seq-len", "0"], "argument --seq-len: must be an integer >= 1"),
    (["--vocab-size", "0"], "argument --vocab-size: must be an integer >= 1"),
    (["--measure-recompute", "0"], "argument --measure-recompute: must be an integer >= 1"),
    (["--batch-size", "12", "--world-size", "8"], "does not divide over 8 ranks: use a multiple of 8"),
    (["--preset", "gpt5"], "unknown model 'gpt5'"),
])
def test_planner_arguments_are_checked_before_any_planning(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        R.main(["memory", *argv])
    captured = capsys.readouterr()
    assert e.value.code == 2 and says in captured.err and not captured.out, captured.err


@pytest.mark.parametrize("batch, seq_len, world, budget", [
    (8, 1024, 0, 80), (-8, 1024, 1, 80), (8, -1024, 1, 80), (8, 1024, 1, -80),
    (8, 1024, 1, float("nan")), (8, 1024, 1, float("inf")), (12, 1024, 8, 80)])
def test_plan_refuses_sizes_no_run_can_have(batch, seq_len, world, budget):
    with pytest.raises(P.PlanError):  # (a negative size would have made a plan "fit")
        P.plan(MODELS["124M"], batch, seq_len, world, budget, "bf16")


def test_measuring_recomputation_refuses_a_model_this_machine_cannot_hold(capsys, monkeypatch):
    monkeypatch.setattr(R, "_memory_here", lambda: 16e9)  # a 16 GB machine, whatever this one is
    with pytest.raises(SystemExit) as e:
        R.main(["memory", "--preset", "7B", "--measure-recompute", "1"])  # ~28 GB of fp32 weights alone
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--measure-recompute builds 7B here" in err and "16.0 GB free" in err, err
