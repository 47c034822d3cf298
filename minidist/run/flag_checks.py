"""The checks of train_gpt's flags that span several flags (the tensor- and pipeline-
parallel axes against the world, the model and what is built), and --config, a TOML file
of flags. Chapter 10 (tensor parallelism) and chapter 11 (pipelines, recipes) add them;
minidist/run/flags.py calls them before any process-group work. Exercised by
`pytest tests/test_train_gpt.py tests/test_recipes.py`.
"""

from __future__ import annotations

import argparse
import tomllib


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
