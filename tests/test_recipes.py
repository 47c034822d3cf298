"""--config FILE (chapter 11): every recipe in recipes/ parses and passes resolve_args at the
world size it is written for, without running, and fits the memory of the machine it names
by the planner's model (minidist.compose.plan_mesh.peak_memory: an 80 GB GPU less the planner's
margin, or the CPU budget); the command line overrides a file; a bad key or value exits 2
naming it."""

from pathlib import Path

import pytest

from minidist.data import get_tokenizer
from minidist.run.flags import parse_args, resolve_args
from minidist.cost_model import GB
from minidist.model import PRESETS, GPTConfig
from minidist.memory.plan import CPU_BUDGET_GB, GPU_MARGIN
from minidist.compose.plan_mesh import peak_memory

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
WORLD = {"cpu_default.toml": 2, "gpt2_124m_8gpu_zero1.toml": 8, "tp2_pp2_4gpu.toml": 4}


def test_every_recipe_is_listed():
    assert sorted(p.name for p in RECIPES.glob("*.toml")) == sorted(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_recipe_resolves(name, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(WORLD[name]))
    monkeypatch.setenv("RANK", "0")  # as torchrun sets them
    # checked as it would start, on this CPU machine: --device cpu overrides a GPU recipe's
    # "cuda" (the command line wins), and the checkpoints go to a fresh folder
    args = resolve_args(parse_args(["--config", str(RECIPES / name), "--device", "cpu",
                                    "--out-dir", str(tmp_path)]), WORLD[name])
    assert args.device == "cpu" and args.config == str(RECIPES / name)
    if name.startswith("tp2_pp2"):
        assert (args.tp, args.sequence_parallel, args.pp, args.pp_schedule, args.grad_accum_steps) == \
            (2, True, 2, "1f1b", 8)
    if name.startswith("gpt2"):
        assert (args.preset, args.zero_stage, args.batch_size, args.precision) == ("gpt2", 1, 512, "bf16")
    # it plans: the configuration fits its machine's memory per rank (the recipe's device, read again)
    device = parse_args(["--config", str(RECIPES / name)]).device
    cfg = GPTConfig(**{**PRESETS[args.preset], "block_size": args.seq_len,
                       "vocab_size": get_tokenizer(args.tokenizer).n_vocab,
                       **{k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd")}})
    dp = WORLD[name] // (args.tp * args.pp)
    peak = peak_memory(cfg, args.batch_size, args.seq_len, dp, args.tp, args.pp, args.zero_stage,
                       args.grad_accum_steps, args.activation_checkpointing == "blocks",
                       args.sequence_parallel, args.precision)
    budget = 80 * GB * (1 - GPU_MARGIN) if device == "cuda" else CPU_BUDGET_GB * GB
    assert 0 < peak <= budget, f"{name}: {peak / GB:.1f} GB per rank, over {budget / GB:.1f}"


def test_command_line_overrides_the_file(tmp_path):
    cfg = tmp_path / "r.toml"
    cfg.write_text('batch-size = 16\nsequence_parallel = false\ndp = "flat"\nlr = 1e-3\n')
    args = parse_args(["--config", str(cfg), "--batch-size", "8"])
    assert (args.batch_size, args.dp, args.lr, args.sequence_parallel) == (8, "flat", 1e-3, False)


@pytest.mark.parametrize("text, message", [
    ("bogus_key = 1", "unknown key 'bogus_key'"),
    ("lr = -1", "lr = -1: must be a finite number > 0"),
    ('dp = "ring"', "dp = 'ring': use one of naive, flat, bucketed"),
    ("sequence_parallel = 1", "is a switch: use true or false"),
    ("steps = [1, 2]", "takes one number or word"),
    ("steps = ", "not valid TOML"),
])
def test_bad_config_exits_2_naming_it(text, message, tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text + "\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(cfg)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_missing_config_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(tmp_path / "none.toml")])
    assert e.value.code == 2 and "none.toml" in capsys.readouterr().err
