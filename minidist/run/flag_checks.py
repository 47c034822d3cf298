"""The checks of train_gpt's flags that span several flags (the tensor-parallel, context-parallel
and expert axes against the world, the model and what is built, ZeRO-3's policy; the pipeline's are in
minidist/run/pipeline_checks.py), --config, a TOML file of
flags, and the `auto` flags filled in by the planners. Chapter 10 (tensor parallelism),
chapter 11 (pipelines, recipes, the planner on a mesh) and chapter 09 (the planner) add them;
minidist/run/flags.py calls them before any process-group work. Exercised by
`pytest tests/test_train_gpt.py tests/test_recipes.py tests/test_plan.py`.
"""

from __future__ import annotations

import argparse
import os
import re
import reprlib
import tomllib

import torch

from minidist import data
from minidist.files import NotARegularFile, read_bounded
from minidist.compose.plan_mesh import plan_on_mesh, zero_stages
from minidist.memory.plan import PlanError, default_budget_gb, plan
from minidist.experts import MoEConfig
from minidist.model import PRESETS, GPTConfig, config_num_params


# ---- --config: a TOML file of flags ----------------------------------------------------

CONFIG_BYTES = 2**20  # a recipe is under 1 KB: a MiB of TOML is not one (and /dev/zero never ends)


class FlagParser(argparse.ArgumentParser):
    """train_gpt's parser. After `blame_config`, an error about a flag whose value came from
    the --config file names the file and the key first: that is where to change it."""
    blame = None

    def error(self, message):
        super().error(self.blame(message) if self.blame else message)


def read_config(p, path: str) -> dict:
    """The table of TOML file `path`, or exit 2 naming it. Refused by kind before it is
    opened (a FIFO would block) and read bounded (minidist/files.py)."""
    try:
        return tomllib.loads(read_bounded(path, CONFIG_BYTES, "--config").decode("utf-8"))
    except NotARegularFile as e:
        p.error(f"{e}: name a TOML file of flags, e.g. recipes/cpu_default.toml")
    except OSError as e:
        p.error(f"--config {path}: {e.strerror or e}")
    except UnicodeDecodeError:
        p.error(f"--config {path}: not valid TOML: not UTF-8 text")
    except tomllib.TOMLDecodeError as e:
        p.error(f"--config {path}: not valid TOML: {e}")
    except RecursionError:  # tomllib recurses once per level of [ or {
        p.error(f"--config {path}: nested too deeply to read: the keys are flags, one value each")


def config_values(p, path: str) -> dict:
    """{dest: (key, value)} of the TOML file `path`: keys are the flags' names, with dashes
    or underscores; each value is checked by the flag's own type and choices, so a bad one
    exits 2 naming the file, the key and the value."""
    actions = {a.dest: a for a in p._actions if a.option_strings}
    out = {}
    for key, value in read_config(p, path).items():
        dest = key.replace("-", "_")
        flag = "--" + dest.replace("_", "-")
        where = f"--config {path}: key {key} = {reprlib.repr(value)}"  # (reprlib: short, however nested)
        if dest not in actions or dest in ("help", "config"):
            p.error(f"--config {path}: unknown key {key!r}: the keys are train_gpt's flags "
                    f"(python minidist/train_gpt.py --help), e.g. batch_size = 32")
        action = actions[dest]
        if action.nargs == 0:  # a switch: true or false
            if not isinstance(value, bool):
                p.error(f"{where}: {flag} is a switch: use true or false")
            out[dest] = (key, value)
            continue
        if isinstance(value, (bool, list, dict)):
            p.error(f"{where}: {flag} takes one number or word")
        try:
            parsed = action.type(str(value)) if action.type else str(value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            p.error(f"{where}: {e}")
        if action.choices is not None and parsed not in action.choices:
            p.error(f"{where}: use one of {', '.join(map(str, action.choices))}")
        out[dest] = (key, parsed)
    return out


def config_argv(p: argparse.ArgumentParser, path: str | None) -> list[str]:
    """The flags of the TOML file `path` as a command line, to be put before the real one
    (argparse keeps the last value given: the command line overrides the file; a switch the
    file sets to true, `--no-SWITCH` turns off)."""
    out = []
    for dest, (key, value) in (config_values(p, path) if path else {}).items():
        flag = "--" + dest.replace("_", "-")
        # FLAG=VALUE: a value that starts with a dash is still read as the value
        out.append((flag if value else "--no-" + flag[2:]) if isinstance(value, bool) else f"{flag}={value}")
    return out


def blame_config(p: FlagParser, args) -> None:
    """From here on, an error of `p` that names a flag whose value is the --config file's
    starts "--config FILE: key KEY: ", for every such key (the command line's own values,
    and the file's that the command line replaced, are not blamed)."""
    if not args.config:
        return
    values = config_values(p, args.config)

    def blame(message: str) -> str:
        named = {m.replace("-", "_") for m in re.findall(r"--([a-z][a-z0-9-]*)", message)}
        keys = [key for dest, (key, value) in values.items()
                if dest in named and getattr(args, dest, None) == value]
        return f"--config {args.config}: key{'s' * (len(keys) > 1)} {', '.join(keys)}: {message}" if keys else message
    p.blame = blame


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


def check_context_parallel(p, args, world_size: int) -> None:
    """--cp, --cp-attention and --cp-layout against the world, the model and what is built."""
    cp, what = args.cp, f"--cp {args.cp}"
    if cp == 1:
        given = [f"{f} {v}" for f, v, d in (("--cp-attention", args.cp_attention, "ring"),
                                            ("--cp-layout", args.cp_layout, "zigzag")) if v != d]
        if given:  # (the defaults: what nobody chose)
            p.error(f"{' '.join(given)} splits a sequence over cp ranks and this run has --cp 1: add --cp 2 or more, "
                    "or drop it")
        return
    if args.tp > 1 or args.pp > 1:  # (the mesh has the axis; the cp GPT is cut from a whole model only)
        p.error(f"{what} with {'--tp' if args.tp > 1 else '--pp'} is not built yet: use --cp with data "
                "parallelism alone (world = dp x cp), or --tp / --pp without --cp")
    if world_size % cp:
        p.error(f"{what} does not divide the world of {world_size} ranks: start a multiple of {cp} "
                "ranks (world = dp x cp), or change --cp")
    chunks = 2 * cp if args.cp_layout == "zigzag" else cp
    if args.seq_len % chunks:
        p.error(f"{what} --cp-layout {args.cp_layout}: --seq-len {args.seq_len} does not cut into {chunks} "
                f"equal chunks: use a multiple of {chunks}"
                + (" (or --cp-layout contiguous, a multiple of --cp)" if args.cp_layout == "zigzag" else ""))
    if args.cp_attention == "ulysses" and args.n_head % cp:
        p.error(f"{what} --cp-attention ulysses splits the heads, and --n-head {args.n_head} is not divisible "
                f"by {cp}: use a --cp that divides it, or --cp-attention ring / allgather")
    if args.dropout > 0:
        p.error(f"{what}: context-parallel attention has no attention dropout: use --dropout 0")
    if args.zero_stage == 3:
        p.error(f"{what} with --zero-stage 3 is not built yet: use --zero-stage 0, 1 or 2")
    auto = [f"--{k.replace('_', '-')}" for k in ("zero_stage", "grad_accum_steps", "activation_checkpointing")
            if getattr(args, k) == "auto"]
    if auto:  # the training planner does not count a cp axis (python -m minidist.run.plan mesh does)
        p.error(f"{what} with {' '.join(a + ' auto' for a in auto)}: the planner does not plan a cp axis "
                "for a run: give each a value (python -m minidist.run.plan mesh --help proposes one)")


def check_experts(p, args, world_size: int) -> None:
    """--n-experts, --top-k, --capacity-factor, --moe-every and --ep against the world, the
    model and what is built (chapter 13)."""
    E, ep = args.n_experts, args.ep
    if not E:
        given = [f for f, v, d in (("--ep", ep, 1), ("--top-k", args.top_k, 2), ("--moe-every", args.moe_every, 1),
                                   ("--capacity-factor", args.capacity_factor, 0.0),
                                   ("--aux-loss-weight", args.aux_loss_weight, 0.01)) if v != d]
        if given:
            p.error(f"{' '.join(given)} shape a mixture of experts: add --n-experts E (e.g. --n-experts 4)")
        return
    what = f"--n-experts {E}"
    if args.top_k > E:
        p.error(f"{what} --top-k {args.top_k}: a token goes to at most all the experts: use --top-k <= {E}")
    if args.moe_every > args.n_layer:
        p.error(f"{what} --moe-every {args.moe_every}: the model has --n-layer {args.n_layer}, so no block "
                f"would hold experts: use --moe-every <= {args.n_layer}")
    if max(args.tp, args.pp, args.cp) > 1:
        flag = next(f for f, v in (("--tp", args.tp), ("--pp", args.pp), ("--cp", args.cp)) if v > 1)
        p.error(f"{what} with {flag} is not built yet: use experts with data parallelism and --ep "
                f"(world = dp x ep), or {flag} with a dense GPT")
    if world_size % ep:
        p.error(f"--ep {ep} does not divide the world of {world_size} ranks: start a multiple of {ep} "
                "ranks (world = dp x ep), or change --ep")
    if E % ep:
        p.error(f"{what} do not split over --ep {ep} ranks: use an --n-experts divisible by {ep}")
    if args.dp != "bucketed":
        p.error(f"{what} with --dp {args.dp}: an MoE GPT's gradients are averaged by ExpertSync (one flat "
                "all-reduce after backward, each expert over its replicas): drop --dp")
    if args.zero_stage == 3:
        p.error(f"{what} with --zero-stage 3 is not built yet: use --zero-stage 1 or 2 (AdamW's state, and "
                "at 2 its gradients, sharded, each expert's over its replicas) or 0")
    auto = [f"--{k.replace('_', '-')} auto" for k in ("zero_stage", "grad_accum_steps", "activation_checkpointing")
            if getattr(args, k) == "auto"]
    if auto:
        p.error(f"{what} with {' '.join(auto)}: the planner does not count experts: give each a value")


def check_fsdp_policy(p, args) -> None:
    """--fsdp-param-dtype, ZeRO-3's mixed-precision policy (chapter 06, appendix F), against what
    can follow it: ZeRO-3's own fp32 shards, AdamW on them, and loss scaling where fp16 needs it."""
    d = args.fsdp_param_dtype
    what = f"--fsdp-param-dtype {d}"
    if d is not None and args.zero_stage != 3:
        p.error(f"{what} is ZeRO-3's mixed-precision policy (the parameters gathered in {d}, fp32 master shards): "
                f"add --zero-stage 3 (not auto: the planner counts fp32 gathers), or use --precision {d} (autocast)")
    if d is not None and args.optimizer == "muon":  # (the CPU default)
        p.error(f"{what} with --optimizer muon: Muon keeps whole matrices beside ZeRO-3's fp32 shards "
                f"(minidist/compose/zero_muon.py), so their gradients would be averaged and summed, and its "
                f"momentum kept, in {d}: add --optimizer adamw, or drop {what} (--precision {d} autocasts Muon's run)")
    if d == "fp16" and args.precision != "fp16":
        p.error(f"{what} computes the gradients in fp16, where small ones underflow to zero without loss scaling: "
                "add --precision fp16 (dynamic loss scaling, which reads the fp32 gradient shards), or use bf16")


def moe_of(args) -> MoEConfig | None:
    """The experts train_gpt's flags ask for (None: a dense GPT)."""
    if not args.n_experts:
        return None
    return MoEConfig(args.n_experts, args.top_k, args.capacity_factor, args.aux_loss_weight, args.moe_every)


def rank_memory(device: str) -> int | None:
    """The most bytes one rank can hold: its GPU's memory, or on a CPU the machine's RAM
    (None where the system does not say)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_model(p, args, world_size: int) -> None:
    """The model the flags build: its own checks, here rather than inside every rank after
    start-up, and a size that some run could hold: fp32 weights and gradients, 8 bytes a
    parameter (every technique here keeps both), over every rank's memory at once (the most
    ZeRO-3, --tp and --pp could spread them). A larger one fails at its first allocation."""
    try:
        cfg = model_of(args, vocab_size=1)  # (the embedding table left out: a lower bound)
    except (ValueError, ZeroDivisionError) as e:
        p.error(f"--n-layer/--n-head/--n-embd: {e}")
    params, memory = config_num_params(cfg), rank_memory(args.device)
    if memory is not None and 8 * params > world_size * memory:
        p.error(f"--n-layer {args.n_layer} --n-embd {args.n_embd}: {params / 1e9:,.1f}B parameters, whose fp32 "
                f"weights and gradients alone take {8 * params / 2**30:,.0f} GiB, more than the "
                f"{world_size * memory / 2**30:,.0f} GiB of all {world_size} rank(s) together: use a smaller model")


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
                                   bucket_cap_mb=args.bucket_cap_mb, schedule=args.pp_schedule,
                                   virtual_stages=args.pp_virtual_stages)
            stage, accum = c.zero, c.micro
        else:
            c, line = plan(cfg, args.batch_size, args.seq_len, world_size, budget, args.precision, zeros, accums,
                           ckpts, args.bucket_cap_mb)
            stage, accum = c.stage, c.accum
    except PlanError as e:
        p.error(f"the planner: {e}")
    return {"zero_stage": stage, "grad_accum_steps": accum, "plan": line,
            "activation_checkpointing": "blocks" if c.checkpointed else "none"}
