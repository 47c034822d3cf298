"""Every technique as a flag: train_gpt's command line, and the checks that run before any
process-group work, so that a bad flag costs nothing and hangs nothing. Chapter 01
(chapters/01_gpt.md) introduces the run; each later chapter adds its flags. Exercised by:

    python minidist/train_gpt.py --help
    pytest tests/test_train_gpt.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import data
from minidist.run import flag_types as ft, outputs  # ft: each flag's type and range
from minidist.run.environment import ENVIRONMENT, check_environment  # noqa: F401 (ENVIRONMENT: its table)
from minidist.run.flag_checks import (FlagParser, blame_config, check_context_parallel, check_experts, check_model,
                                      check_fsdp_policy, check_tensor_parallel, config_argv, plan_auto)
from minidist.run.pipeline_checks import check_pipeline
from minidist.dist import env_world_size
from minidist.run.locks import in_use_message, lock_holder
from minidist.model import PRESETS
from minidist.scaler import LossScaler
from minidist.checkpoint.resume import resume_from

# What "auto" means on each kind of device: a run that fits the machine.
AUTO = {
    # CPU: Muon for the hidden matrices, 240 steps, reached a lower validation loss than
    # AdamW's 480 in 0.62 times the wall time (chapter 07, section 7); on a GPU
    # AdamW stays until the same comparison has been made there
    "cpu": dict(preset="tiny", tokenizer="gpt2-2048", batch_size=32, steps=240, lr=3e-3,
                warmup_steps=20, eval_interval=80, log_interval=20, optimizer="muon"),
    "cuda": dict(preset="gpt2", tokenizer="gpt2", batch_size=32, steps=300, lr=6e-4,
                 warmup_steps=30, eval_interval=50, log_interval=10, optimizer="adamw"),
}


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(description="Train a GPT with any combination of minidist's techniques, each a flag.",
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--preset", default=None, choices=sorted(PRESETS), help="model size (auto by device)")
    a("--n-layer", type=ft.layers), a("--n-head", type=ft.heads), a("--n-embd", type=ft.width)
    a("--dropout", type=ft.below_one, default=0.0)
    a("--seq-len", type=ft.tokens, help="tokens per sequence (default: the preset's block_size)")
    a("--batch-size", type=ft.sequences, help="global batch in sequences, over all ranks")
    a("--steps", type=ft.steps, help="optimizer steps")
    a("--lr", type=ft.learning_rate, help="peak learning rate")
    a("--min-lr-ratio", type=ft.up_to_one, default=0.1, help="final lr as a fraction of --lr")
    a("--warmup-steps", type=ft.steps_or_none, help="linear warmup steps")
    a("--weight-decay", type=ft.decay, default=0.1)
    a("--optimizer", choices=["adamw", "muon"],
      help="muon: Muon for the hidden matrices (shared across ranks), AdamW for the rest "
           "(auto: muon on CPU, adamw on GPU)")
    a("--muon-lr", type=ft.learning_rate, default=0.02, help="Muon's peak learning rate (same schedule)")
    a("--muon-momentum", type=ft.below_one, default=0.95)
    a("--muon-weight-decay", type=ft.decay, default=0.0)
    a("--muon-ns-coefficients", default="jordan", choices=["jordan", "polar_express"],
      help="Newton-Schulz coefficients: Keller Jordan's fixed quintic, or the Polar Express "
           "schedule (a quintic per step; chapter 07)")
    a("--grad-clip", type=ft.clip, default=1.0, help="max global grad norm (0: off)")
    a("--tokenizer", help="gpt2 or gpt2-<V> (auto: gpt2-2048 on CPU, gpt2 on GPU)")
    a("--data", help="glob of llm.c .bin train shards (default: embedded Shakespeare)")
    a("--val-data", help="glob of validation shards (with --data)")
    a("--eval-interval", type=ft.steps, help="steps between validation evaluations")
    a("--eval-windows", type=ft.windows, default=64, help="sequences per mid-run evaluation")
    a("--final-eval-windows", type=ft.windows, help="sequences in the final evaluation (default: all)")
    a("--log-interval", type=ft.steps, help="steps between log lines")
    a("--dp", default="bucketed", choices=["naive", "flat", "bucketed"],
      help="gradient averaging: one all-reduce per parameter after backward, one of a flat "
           "buffer after backward, or buckets overlapped with backward (minidist.ddp.DDP)")
    a("--bucket-cap-mb", type=ft.mib, default=25.0,
      help="MiB per gradient bucket, the same meaning for --dp bucketed and every --zero-stage: "
           "0 one bucket per parameter, inf one bucket for everything; at --zero-stage 3 a "
           "transformer block larger than the cap is cut into units of about that size")
    a("--zero-stage", type=ft.int_or_auto, default=0, choices=[0, 1, 2, 3, "auto"],
      help="ZeRO: 1 shards AdamW's state over ranks, 2 also the gradients (reduce-scattered "
           "during backward), 3 also the parameters (gathered per block, prefetched); 0 is "
           "plain data parallelism (--dp); auto: the planner picks (chapter 09, minidist/memory/plan.py)")
    a("--tp", type=ft.heads, default=1,
      help="tensor parallelism (chapter 10): every layer split over this many ranks; the world "
           "is dp x tp (x pp), data parallelism (and ZeRO 1-2) over the dp ranks")
    a("--pp", type=ft.layers, default=1,
      help="pipeline parallelism (chapter 11): the blocks cut into this many stages, one per rank; "
           "the world is dp x tp x pp, --grad-accum-steps micro-batches flow through the stages")
    a("--cp", type=ft.heads, default=1,
      help="context parallelism (chapter 12): every sequence split over this many ranks; the world "
           "is dp x cp, one gradient all-reduce over all of them")
    a("--cp-attention", default="ring", choices=["ring", "allgather", "ulysses"],
      help="with --cp: K, V blocks around a ring, all-gathered, or all-to-all over heads (Ulysses)")
    a("--cp-layout", default="zigzag", choices=["zigzag", "contiguous"],
      help="with --cp: rank r holds chunks r and 2cp-1-r of 2cp (even causal work), or chunk r of cp")
    a("--n-experts", type=ft.experts_or_dense, default=0,
      help="mixture of experts (chapter 13): this many expert MLPs in each MoE block (0: a dense GPT)")
    a("--top-k", type=ft.experts, default=2, help="with --n-experts: the experts each token goes to")
    a("--capacity-factor", type=ft.capacity, default=0.0, help="with --n-experts: an expert's slots, "
      "times its even share of the tokens (0: no limit, dropless); choices past it are dropped, counted")
    a("--aux-loss-weight", type=ft.decay, default=0.01, help="with --n-experts: the balance loss's weight")
    a("--moe-every", type=ft.layers, default=1, help="with --n-experts: an MoE in every N-th block")
    a("--ep", type=ft.experts, default=1, help="with --n-experts: expert parallelism, the experts spread "
      "over this many ranks, tokens sent to them by all-to-all; the world is dp x ep")
    a("--pp-schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"],
      help="with --pp: all forwards then all backwards (gpipe); one forward one backward (1f1b); "
           "1f1b over --pp-virtual-stages chunks per stage, the micro-batches in groups of --pp "
           "(interleaved); 1f1b with each backward split, its weight half deferred (zb-h1)")
    a("--pp-virtual-stages", type=ft.layers, default=2,
      help="with --pp-schedule interleaved: chunks per stage (rank r holds chunks r, r + pp, ...)")
    a("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
      help="with --tp: layer norms, dropout and the residual stream split over the sequence too")
    a("--grad-accum-steps", type=ft.or_auto(ft.sequences), default=1,
      help="micro-steps per optimizer step; --batch-size is split over ranks and micro-steps; "
           "auto: the planner picks")
    a("--activation-checkpointing", default="none", choices=["none", "blocks", "auto"],
      help="blocks: keep only each transformer block's input and recompute the block in "
           "backward (minidist/memory/recompute.py); auto: the planner decides")
    a("--memory-budget-gb", type=ft.budget_gb,
      help="per rank, for the auto flags (default: the GPU's memory less 10%%; on CPU 4)")
    a("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
      help="autocast dtype of the forward pass; parameters, gradients and optimizer state stay "
           "fp32; fp16 always runs with dynamic loss scaling (minidist.scaler.LossScaler)")
    a("--fsdp-param-dtype", choices=["bf16", "fp16"],
      help="with --zero-stage 3 and AdamW: ZeRO-3's mixed-precision policy (FSDP2's param_dtype): parameters "
           "gathered, forward and backward run, gradients reduce-scattered in it; AdamW steps fp32 master shards")
    a("--loss-scale-init", type=ft.loss_scale, default=2.0**16,
      help="fp16: the first loss scale, 1 to fp32's largest (3.4e38)")
    a("--loss-scale-growth-interval", type=ft.steps, default=2000,
      help="fp16: clean steps before the loss scale doubles")
    a("--loss-scale-hysteresis", type=ft.steps, default=1,
      help="fp16: consecutive overflows before the loss scale halves (each one skips its step)")
    a("--seed", type=ft.seed_int, default=1337)
    a("--sample-tokens", type=ft.sample, default=120, help="tokens to generate at the end")
    a("--out-dir", type=ft.folder_name, default="out", help="where metrics.jsonl, loss.png, summary.json go")
    a("--checkpoint-every", type=ft.steps_or_none, default=0,
      help="save a checkpoint in OUT_DIR/checkpoints every N steps and at the end (0: never)")
    a("--keep-checkpoints", type=ft.checkpoints, default=2, help="the newest checkpoints to keep")
    a("--resume", help="'auto': continue from the newest checkpoint in OUT_DIR/checkpoints if "
      "there is one (for torchrun --max-restarts); or a checkpoint folder, saved on any number "
      "of ranks at any --zero-stage and --tp (into an --out-dir without another run's checkpoints)")
    a("--config", help="a TOML file whose keys are these flags (dashes or underscores), e.g. a "
      "file in recipes/; flags on the command line override it")
    a("--debug-collectives", action=argparse.BooleanOptionalAction, default=False,
      help="check every collective against every rank's; name the first that differs (slow)")
    return p


# what a resumed run may change: how the work is spread and watched, not what it computes
MAY_CHANGE_ON_RESUME = {"device", "dp", "bucket_cap_mb", "zero_stage", "grad_accum_steps",
                        "precision", "loss_scale_init", "loss_scale_growth_interval",
                        "loss_scale_hysteresis", "eval_interval", "eval_windows", "log_interval",
                        "final_eval_windows", "sample_tokens", "out_dir", "checkpoint_every",
                        "keep_checkpoints", "resume", "debug_collectives",
                        "activation_checkpointing", "memory_budget_gb", "plan",
                        "tp", "sequence_parallel", "pp", "pp_schedule", "pp_virtual_stages", "config", "cp",
                        "cp_attention", "cp_layout", "ep", "fsdp_param_dtype"}  # checkpoints hold full fp32 ranges


def resolve_args(args, world_size: int) -> argparse.Namespace:
    """Fill in the device-dependent defaults and reject what cannot run: every flag, every
    environment variable minidist reads, every file and folder named. Runs before any
    process-group or data work, so a bad input costs nothing and hangs nothing; each is an
    exit with status 2 and one line naming the input and what to use."""
    p = build_parser()
    blame_config(p, args)  # an error about a value from --config names the file and the key
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available: use --device cpu")
    defaulted = {k for k in AUTO[args.device] if getattr(args, k) is None}
    for k, v in AUTO[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    check_environment(p, args, world_size)  # (after the defaults: MINIDIST_FAULT's step against --steps)
    context = PRESETS[args.preset]["block_size"]
    if args.seq_len is None:
        args.seq_len = context
    if args.seq_len > context:  # the position table would grow: another model, not a longer run
        p.error(f"--seq-len {args.seq_len} is longer than the {args.preset} preset's context "
                f"({context} tokens): use --seq-len <= {context}, or a preset with a longer context")
    for k in ("n_layer", "n_head", "n_embd"):  # resolved: `--n-layer 4` on tiny is tiny
        if getattr(args, k) is None:
            setattr(args, k, PRESETS[args.preset][k])
    check_model(p, args, world_size)  # its own checks, and a size that fits all the ranks' memory
    if args.warmup_steps >= args.steps:  # (each number's own range: its type, build_parser)
        p.error(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps} with --steps {args.steps}"
                + (f" ({args.warmup_steps} is the {args.device} default: give --warmup-steps below --steps)"
                   if "warmup_steps" in defaulted else ""))
    args.plan = None  # chapter 09: the planner fills in what is "auto", and says why
    check_pipeline(p, args, world_size)  # chapters 11 and 10: the mesh, before the planner keeps to it
    check_tensor_parallel(p, args, world_size)
    check_context_parallel(p, args, world_size)
    check_experts(p, args, world_size)
    check_fsdp_policy(p, args)  # (after the mesh's checks: each refuses ZeRO-3 where it is not built)
    if "auto" in (args.zero_stage, args.grad_accum_steps, args.activation_checkpointing):
        vars(args).update(plan_auto(p, args, world_size))
    dp = world_size // (args.tp * args.pp * args.cp)  # a replica's tp, cp ranks and stages share its batch
    parts = dp * args.grad_accum_steps
    if args.batch_size % parts:
        p.error(f"--batch-size {args.batch_size} does not divide across {dp} data-parallel ranks x "
                f"{args.grad_accum_steps} micro-steps: use a multiple of {parts}, "
                f"e.g. {parts * max(1, args.batch_size // parts)}")
    try:
        make_scaler(args)
    except ValueError as e:
        p.error(f"loss scaling: {e}")
    if args.zero_stage and args.dp != "bucketed":  # (bucketed is the default)
        p.error(f"--dp {args.dp} with --zero-stage {args.zero_stage}: ZeRO does its own gradient "
                "averaging (reduce-scatters during backward); drop --dp, or use --zero-stage 0")
    out = Path(args.out_dir)
    problem = outputs.output_problem(out)  # a folder this process can write, found now
    if problem:
        p.error(problem)
    holder = lock_holder(out)  # another run writing here: refused before anything is read
    if holder is not None:
        p.error(in_use_message(out, holder))
    try:  # the global batch of step s does not depend on the world size or micro-steps
        args.resume = resume_from(args.resume, out / "checkpoints", args.checkpoint_every, vars(args),
                                  MAY_CHANGE_ON_RESUME)
    except ValueError as e:
        p.error(f"--resume: {e}")
    if bool(args.data) != bool(args.val_data):
        p.error("--data and --val-data go together: give both or neither")
    try:
        vocab = data.get_tokenizer(args.tokenizer).n_vocab
    except (ValueError, ImportError, OSError) as e:
        p.error(f"--tokenizer: {e}")
    flag = "--data"
    try:
        if args.data is None:
            data.corpus_dir()
        else:
            for flag, pattern in (("--data", args.data), ("--val-data", args.val_data)):
                # reads the headers, checks the ids
                data.TokenLoader(pattern, args.seq_len, world_size, 0, world_size, vocab_size=vocab)
    except (ValueError, ImportError, OSError) as e:
        fix = f": name the shard files, e.g. '{Path(e.filename) / '*.bin'}'" if isinstance(e, IsADirectoryError) else ""
        p.error(f"{flag}: {e}{fix}" if args.data else str(e))
    problem = outputs.output_problem(Path(args.out_dir), checkpoints=bool(args.checkpoint_every))
    if problem:  # every path the run writes, tried now rather than at the first save or the end
        p.error(problem)
    return args


def parse_args(argv) -> argparse.Namespace:
    """The command line, after the --config file's flags (so the command line overrides
    them); a bad key or value in the file exits 2 naming it."""
    p = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    return p.parse_args(config_argv(p, known.config) + list(argv))


def world_size_from_env() -> int:
    """WORLD_SIZE (torchrun's), 1 without it; another value exits 2 naming it."""
    try:
        return env_world_size()
    except ValueError as e:
        build_parser().error(str(e))


def agree_across_ranks(settings: dict) -> None:
    """Every rank compares its resolved settings with every other's (one all_gather of
    a few KB, at start-up): ranks given different flags, say on two nodes, would train
    diverged replicas or hang in a collective. On a difference, every rank raises the
    same error at once, naming the settings and the ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, json.dumps(settings, sort_keys=True, default=str))
    ranks = [json.loads(s) for s in everyone]
    diffs = [f"--{k.replace('_', '-')}: {ranks[0].get(k)!r} on rank 0, {r.get(k)!r} on rank {i}"
             for i, r in enumerate(ranks) for k in sorted(set(r) | set(ranks[0]))
             if r.get(k) != ranks[0].get(k)]
    if diffs:
        raise ValueError("the ranks were started with different settings: " + "; ".join(diffs[:10])
                         + ". Start every rank (every node) with the same flags")


def optimizer_options(args) -> dict:
    """minidist.compose.build.make_optimizers' keywords, from the flags."""
    return {"param_dtype": {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.fsdp_param_dtype),
            **{k: getattr(args, k) for k in ("optimizer", "lr", "weight_decay", "zero_stage", "bucket_cap_mb",
                                             "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_coefficients")}}


def make_scaler(args) -> LossScaler:
    """fp16 gets dynamic loss scaling; fp32 and bf16 a disabled (pass-through) scaler."""
    return LossScaler(init_scale=args.loss_scale_init, growth_interval=args.loss_scale_growth_interval,
                      hysteresis=args.loss_scale_hysteresis, enabled=args.precision == "fp16")


