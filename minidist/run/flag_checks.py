"""The checks of train_gpt's flags that span several flags (the tensor- and pipeline-
parallel axes against the world, the model and what is built), --config, a TOML file of
flags, and the `auto` flags filled in by the planners. Chapter 10 (tensor parallelism),
chapter 11 (pipelines, recipes, the planner on a mesh) and chapter 09 (the planner) add them;
minidist/run/flags.py calls them before any process-group work. Exercised by
`pytest tests/test_train_gpt.py tests/test_recipes.py tests/test_plan.py`.
"""

from __future__ import annotations

import argparse
import tomllib

from minidist import data
from minidist.compose.plan_mesh import plan_on_mesh, zero_stages
from minidist.memory.plan import PlanError, default_budget_gb, plan
from minidist.model import PRESETS, GPTConfig


def config_argv(p: argparse.ArgumentParser, path: str | None) -> list[str]:
    """The flags of the TOML file `path` as a command line, to be put before the real one
    (argparse keeps the last value given: the command line overrides the file). Keys are
    the flags' names, with dashes or underscores; each value is checked by the flag's own
    type and choices here, so a bad one exits 2 naming the file, the key and the value."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        p.error(f"--config {path}: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        p.error(f"--config {path}: not valid TOML: {e}")
    except UnicodeDecodeError:
        p.error(f"--config {path}: not valid TOML: not UTF-8 text")
    actions = {a.dest: a for a in p._actions if a.option_strings}
    out = []
    for key, value in table.items():
        dest = key.replace("-", "_")
        flag = "--" + dest.replace("_", "-")
        where = f"--config {path}: {key} = {value!r}"
        if dest not in actions or dest in ("help", "config"):
            p.error(f"--config {path}: unknown key {key!r}: the keys are train_gpt's flags "
                    f"(python minidist/train_gpt.py --help), e.g. batch_size = 32")
        action = actions[dest]
        if action.nargs == 0:  # a switch: true or false
            if not isinstance(value, bool):
                p.error(f"{where}: {flag} is a switch: use true or false")
            out += [flag] if value else []
            continue
        if isinstance(value, (bool, list, dict)):
            p.error(f"{where}: {flag} takes one number or word")
        text = str(value)
        try:
            parsed = action.type(text) if action.type else text
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            p.error(f"{where}: {e}")
        if action.choices is not None and parsed not in action.choices:
            p.error(f"{where}: use one of {', '.join(map(str, action.choices))}")
        out += [flag, text]
    return out


def check_pipeline(p, args, world_size: int) -> None:
    """--pp and --pp-schedule against the world, the model and the other flags."""
    pp, what = args.pp, f"--pp {args.pp}"
    if pp == 1:
        return
    if world_size % (pp * args.tp):
        n = pp * args.tp
        p.error(f"{what}{f' x --tp {args.tp}' if args.tp > 1 else ''} does not divide the world of "
                f"{world_size} ranks: start a multiple of {n} ranks (world = dp x tp x pp), or change --pp")
    if args.n_layer < pp:
        p.error(f"{what}: each stage holds at least one block and the model has --n-layer "
                f"{args.n_layer}: use --pp <= {args.n_layer}")
    if args.zero_stage in (2, 3):
        p.error(f"{what} with --zero-stage {args.zero_stage}: ZeRO-{args.zero_stage} would "
                f"{'reduce-scatter the gradients' if args.zero_stage == 2 else 're-gather the parameters'} "
                "for every micro-batch of the pipeline (the field pairs pipelining with ZeRO-1 only): "
                "use --zero-stage 1 or 0")


def check_tensor_parallel(p, args, world_size: int) -> None:
    """--tp and --sequence-parallel against the world, the model and what is built."""
    tp, what = args.tp, f"--tp {args.tp}"
    if args.sequence_parallel and tp == 1:
        p.error("--sequence-parallel splits over the tensor-parallel ranks: add --tp 2 or more")
    if tp == 1:
        return
    if world_size % tp:
        p.error(f"{what} does not divide the world of {world_size} ranks: start a multiple of {tp} "
                "ranks (world = dp x tp), or change --tp")
    if args.n_head % tp:
        p.error(f"{what}: attention is split by heads, and --n-head {args.n_head} is not divisible "
                f"by {tp}: use a --tp that divides it")
    if args.sequence_parallel and args.seq_len % tp:
        p.error(f"{what} --sequence-parallel: --seq-len {args.seq_len} is not divisible by {tp}: "
                f"use a multiple of {tp}")
    if args.zero_stage == 3:  # (checkpoints are built: saved by full name and range, they resume at any --tp)
        p.error(f"{what} with --zero-stage 3 is not built yet: use --zero-stage 0, 1 or 2 (or auto)")


def model_of(args, vocab_size: int, dropout: float = 0.0) -> GPTConfig:
    """The model train_gpt's flags build: the preset, with --n-layer/--n-head/--n-embd."""
    return GPTConfig(**{**PRESETS[args.preset], "block_size": args.seq_len, "vocab_size": vocab_size,
                        "dropout": dropout, **{k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd")
                                               if getattr(args, k) is not None}})


def plan_auto(p, args, world_size: int) -> dict:
    """What the planner chose for the `auto` flags (--zero-stage, --grad-accum-steps,
    --activation-checkpointing) as flag values, and its line of reasoning ("plan"): chapter
    09's planner, or with --tp or --pp chapter 11's on the mesh given. ZeRO stands on the
    bucketed DDP's layout (flags.py); with Muon the plan counts AdamW's two moments for every
    parameter, where Muon keeps one: an over-estimate, on the safe side."""
    try:
        vocab = data.get_tokenizer(args.tokenizer).n_vocab
    except (ValueError, ImportError, OSError) as e:
        p.error(f"--tokenizer: {e}")
    cfg, on_a_mesh = model_of(args, vocab), args.tp > 1 or args.pp > 1
    zeros = tuple(z for z in (zero_stages(args.tp, args.pp) if on_a_mesh else (0, 1, 2, 3))
                  if args.dp == "bucketed" or z == 0) if args.zero_stage == "auto" else (args.zero_stage,)
    accums = None if args.grad_accum_steps == "auto" else [args.grad_accum_steps]
    ckpts = (False, True) if args.activation_checkpointing == "auto" else (args.activation_checkpointing == "blocks",)
    budget = args.memory_budget_gb or default_budget_gb(args.device)
    try:
        if on_a_mesh:
            c, line = plan_on_mesh(cfg, args.batch_size, args.seq_len, world_size // (args.tp * args.pp), args.tp,
                                   args.pp, budget, args.precision, args.sequence_parallel, zeros, accums, ckpts,
                                   bucket_cap_mb=args.bucket_cap_mb)
            stage, accum = c.zero, c.micro
        else:
            c, line = plan(cfg, args.batch_size, args.seq_len, world_size, budget, args.precision, zeros, accums,
                           ckpts, args.bucket_cap_mb)
            stage, accum = c.stage, c.accum
    except PlanError as e:
        p.error(f"the planner: {e}")
    return {"zero_stage": stage, "grad_accum_steps": accum, "plan": line,
            "activation_checkpointing": "blocks" if c.checkpointed else "none"}
