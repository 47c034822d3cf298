"""Every technique as a flag: train_gpt's command line, and the checks that run before any
process-group work, so that a bad flag costs nothing and hangs nothing. Chapter 01
(chapters/01_gpt.md) introduces the run; each later chapter adds its flags. Exercised by:

    python minidist/train_gpt.py --help
    pytest tests/test_train_gpt.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import checkpoint, data, faults
from minidist.model import PRESETS, GPTConfig
from minidist.plan import PlanError, resolve_auto
from minidist.scaler import LossScaler

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
    p = argparse.ArgumentParser(description="Train a GPT with any combination of minidist's techniques, each a flag.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--preset", default=None, choices=sorted(PRESETS), help="model size (auto by device)")
    a("--n-layer", type=int), a("--n-head", type=int), a("--n-embd", type=int)
    a("--dropout", type=float, default=0.0)
    a("--seq-len", type=int, help="tokens per sequence (default: the preset's block_size)")
    a("--batch-size", type=int, help="global batch in sequences, over all ranks")
    a("--steps", type=int, help="optimizer steps")
    a("--lr", type=float, help="peak learning rate")
    a("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    a("--warmup-steps", type=int, help="linear warmup steps")
    a("--weight-decay", type=float, default=0.1)
    a("--optimizer", choices=["adamw", "muon"],
      help="muon: Muon for the hidden matrices (shared across ranks), AdamW for the rest "
           "(auto: muon on CPU, adamw on GPU)")
    a("--muon-lr", type=float, default=0.02, help="Muon's peak learning rate (same schedule)")
    a("--muon-momentum", type=float, default=0.95)
    a("--muon-weight-decay", type=float, default=0.0)
    a("--muon-ns-coefficients", default="jordan", choices=["jordan", "polar_express"],
      help="Newton-Schulz coefficients: Keller Jordan's fixed quintic, or the Polar Express "
           "schedule (a quintic per step; chapter 07)")
    a("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    a("--tokenizer", help="gpt2 or gpt2-<V> (auto: gpt2-2048 on CPU, gpt2 on GPU)")
    a("--data", help="glob of llm.c .bin train shards (default: embedded Shakespeare)")
    a("--val-data", help="glob of validation shards (with --data)")
    a("--eval-interval", type=int, help="steps between validation evaluations")
    a("--eval-windows", type=int, default=64, help="sequences per mid-run evaluation")
    a("--final-eval-windows", type=int, help="sequences in the final evaluation (default: all)")
    a("--log-interval", type=int, help="steps between log lines")
    a("--dp", default="bucketed", choices=["naive", "flat", "bucketed"],
      help="gradient averaging: one all-reduce per parameter after backward, one of a flat "
           "buffer after backward, or buckets overlapped with backward (minidist.ddp.DDP)")
    a("--bucket-cap-mb", type=float, default=25.0,
      help="MiB per gradient bucket, the same meaning for --dp bucketed and every --zero-stage: "
           "0 one bucket per parameter, inf one bucket for everything; at --zero-stage 3 a "
           "transformer block larger than the cap is cut into units of about that size")
    a("--zero-stage", type=_int_or_auto, default=0, choices=[0, 1, 2, 3, "auto"],
      help="ZeRO: 1 shards AdamW's state over ranks, 2 also the gradients (reduce-scattered "
           "during backward), 3 also the parameters (gathered per block, prefetched); 0 is "
           "plain data parallelism (--dp); auto: the planner picks (chapter 09, minidist/plan.py)")
    a("--grad-accum-steps", type=_int_or_auto, default=1,
      help="micro-steps per optimizer step; --batch-size is split over ranks and micro-steps; "
           "auto: the planner picks")
    a("--activation-checkpointing", default="none", choices=["none", "blocks", "auto"],
      help="blocks: keep only each transformer block's input and recompute the block in "
           "backward (minidist/recompute.py); auto: the planner decides")
    a("--memory-budget-gb", type=float,
      help="per rank, for the auto flags (default: the GPU's memory less 10%%; on CPU 4)")
    a("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
      help="autocast dtype of the forward pass; parameters, gradients and optimizer state stay "
           "fp32; fp16 always runs with dynamic loss scaling (minidist.scaler.LossScaler)")
    a("--loss-scale-init", type=float, default=2.0**16, help="fp16: the first loss scale")
    a("--loss-scale-growth-interval", type=int, default=2000,
      help="fp16: clean steps before the loss scale doubles")
    a("--loss-scale-hysteresis", type=int, default=1,
      help="fp16: consecutive overflows before the loss scale halves (each one skips its step)")
    a("--seed", type=int, default=1337)
    a("--sample-tokens", type=int, default=120, help="tokens to generate at the end")
    a("--out-dir", default="out", help="where metrics.jsonl, loss.png, summary.json go")
    a("--checkpoint-every", type=int, default=0,
      help="save a checkpoint in OUT_DIR/checkpoints every N steps and at the end (0: never)")
    a("--keep-checkpoints", type=int, default=2, help="the newest checkpoints to keep")
    a("--resume", help="'auto': continue from the newest checkpoint in OUT_DIR/checkpoints if "
      "there is one (for torchrun --max-restarts); or a checkpoint folder, saved on any number "
      "of ranks at any --zero-stage")
    a("--debug-collectives", action="store_true",
      help="check every collective against every rank's; name the first that differs (slow)")
    return p


# what a resumed run may change: how the work is spread and watched, not what it computes
MAY_CHANGE_ON_RESUME = {"device", "dp", "bucket_cap_mb", "zero_stage", "grad_accum_steps",
                        "precision", "loss_scale_init", "loss_scale_growth_interval",
                        "loss_scale_hysteresis", "eval_interval", "eval_windows", "log_interval",
                        "final_eval_windows", "sample_tokens", "out_dir", "checkpoint_every",
                        "keep_checkpoints", "resume", "debug_collectives",
                        "activation_checkpointing", "memory_budget_gb", "plan"}


def _int_or_auto(s: str):
    return s if s == "auto" else int(s)


def resolve_args(args, world_size: int) -> argparse.Namespace:
    """Fill in the device-dependent defaults and reject what cannot run. Runs before any
    process-group work, so a bad flag costs nothing and hangs nothing."""
    p = build_parser()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available: use --device cpu")
    for k, v in AUTO[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    context = PRESETS[args.preset]["block_size"]
    if args.seq_len is None:
        args.seq_len = context
    if args.seq_len > context:  # the position table would grow: another model, not a longer run
        p.error(f"--seq-len {args.seq_len} is longer than the {args.preset} preset's context "
                f"({context} tokens): use --seq-len <= {context}, or a preset with a longer context")
    _check_numbers(p, args)
    for k in ("n_layer", "n_head", "n_embd"):  # resolved: `--n-layer 4` on tiny is tiny
        if getattr(args, k) is None:
            setattr(args, k, PRESETS[args.preset][k])
    try:  # the model's own checks, here rather than inside every rank after start-up
        GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.seq_len)
    except (ValueError, ZeroDivisionError) as e:  # (n_head 0: the divisibility check divides)
        p.error(f"--n-layer/--n-head/--n-embd: {e}")
    for k in ("batch_size", "steps", "seq_len", "eval_interval", "log_interval", "eval_windows",
              "final_eval_windows"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        p.error(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    args.plan = None  # chapter 09: the planner fills in what is "auto"
    if "auto" in (args.zero_stage, args.grad_accum_steps, args.activation_checkpointing):
        if args.memory_budget_gb is not None and not args.memory_budget_gb > 0:
            p.error(f"--memory-budget-gb must be > 0, got {args.memory_budget_gb}")
        try:
            vocab = data.get_tokenizer(args.tokenizer).n_vocab
        except (ValueError, ImportError, FileNotFoundError) as e:
            p.error(str(e))
        try:
            args.plan = resolve_auto(args, world_size, vocab)
        except PlanError as e:
            p.error(f"the planner: {e}")
    if args.grad_accum_steps < 1:
        p.error(f"--grad-accum-steps must be >= 1, got {args.grad_accum_steps}")
    parts = world_size * args.grad_accum_steps
    if args.batch_size % parts:
        p.error(f"--batch-size {args.batch_size} does not divide across {world_size} ranks x "
                f"{args.grad_accum_steps} micro-steps: use a multiple of {parts}, "
                f"e.g. {parts * max(1, args.batch_size // parts)}")
    if args.lr <= 0 or args.muon_lr <= 0:
        p.error(f"--lr and --muon-lr must be > 0, got {args.lr} and {args.muon_lr}")
    try:
        make_scaler(args)
    except ValueError as e:
        p.error(f"loss scaling: {e}")
    if args.zero_stage and args.dp != "bucketed":  # (bucketed is the default)
        p.error(f"--dp {args.dp} with --zero-stage {args.zero_stage}: ZeRO does its own gradient "
                "averaging (reduce-scatters during backward); drop --dp, or use --zero-stage 0")
    if args.checkpoint_every < 0 or args.keep_checkpoints < 1:
        p.error("--checkpoint-every must be >= 0 and --keep-checkpoints >= 1")
    _check_out_dir(p, Path(args.out_dir))
    try:
        faults.parse_fault(os.environ.get("MINIDIST_FAULT"))
    except ValueError as e:
        p.error(str(e))
    root = Path(args.out_dir) / "checkpoints"
    if args.resume is None and args.checkpoint_every and checkpoint.latest(root):
        p.error(f"{root} holds checkpoints of an earlier run: --resume auto continues it; "
                "another --out-dir (or deleting them) starts over")
    try:  # the global batch of step s does not depend on the world size or micro-steps
        args.resume = find_resume(args.resume, root, vars(args), MAY_CHANGE_ON_RESUME)
    except (ValueError, FileNotFoundError) as e:
        p.error(f"--resume: {e}")
    args.resume = args.resume and str(args.resume)
    if bool(args.data) != bool(args.val_data):
        p.error("--data and --val-data go together: give both or neither")
    try:
        vocab = data.get_tokenizer(args.tokenizer).n_vocab
        if args.data is None:
            data.corpus_dir()
        else:
            for pattern in (args.data, args.val_data):  # reads the headers, checks the ids
                data.TokenLoader(pattern, args.seq_len, world_size, 0, world_size, vocab_size=vocab)
    except (ValueError, ImportError, FileNotFoundError) as e:
        p.error(str(e))
    return args


def _check_numbers(p, args) -> None:
    """Every number on the command line is finite (argparse takes "nan" and "inf" as
    floats) and none is negative; a few have an upper bound too."""
    for action in p._actions:
        v = getattr(args, action.dest, None)
        inf_ok = action.dest == "bucket_cap_mb"  # inf: one bucket for everything
        if action.type in (int, float) and v is not None and \
                (math.isnan(v) or v < 0 or (math.isinf(v) and not inf_ok)):
            p.error(f"{action.option_strings[0]} must be a {'' if inf_ok else 'finite '}number >= 0, got {v}")
    if args.dropout >= 1 or args.muon_momentum >= 1 or args.min_lr_ratio > 1:
        p.error(f"--dropout and --muon-momentum must be < 1 and --min-lr-ratio <= 1, got "
                f"{args.dropout}, {args.muon_momentum} and {args.min_lr_ratio}")


def _check_out_dir(p, out: Path) -> None:
    """--out-dir is (or can be made) a folder this process can write: found now, not
    after the whole run."""
    if out.exists() and not out.is_dir():
        p.error(f"--out-dir {out} is a file, not a folder: name a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()  # a write, really tried
    except OSError as e:
        p.error(f"--out-dir {out} cannot be written ({e.strerror or e}): choose another folder")


def _resolved(settings: dict) -> dict:
    """Model sizes as the run builds them (a checkpoint of an older run may hold None)."""
    preset = PRESETS.get(settings.get("preset"), {})
    return {k: preset.get(k) if v is None and k in ("n_layer", "n_head", "n_embd") else v
            for k, v in settings.items()}


def _same_settings(path: Path, settings: dict, may_change) -> None:
    saved = _resolved(checkpoint.read_meta(path)["extra"].get("settings", {}))
    changed = [f"{k}: {saved[k]!r} saved, {v!r} now" for k, v in _resolved(settings).items()
               if k in saved and k not in may_change and saved[k] != v]
    if changed:
        raise ValueError(f"{path} was saved by a run with other settings ({'; '.join(changed)}): "
                         "resume with the same ones, or start over in another folder")


def find_resume(resume: str | None, root, settings: dict, may_change=()) -> Path | None:
    """The checkpoint a run should resume from: resume="auto", the newest intact one under
    `root` (None if there is none yet: a first start; a damaged, incomplete or unreadable
    one is skipped with one line, so a restarted job does not fail the same way on every
    attempt); a path, that checkpoint, which must be intact; None, nothing. Raises
    ValueError, before any work, if it was saved with other `settings` than these (keys in
    `may_change` may differ: how the run is spread, not what it computes)."""
    if resume is None:
        return None
    if resume != "auto":
        _same_settings(Path(resume), settings, may_change)
        bad = checkpoint.verify(resume)
        if bad:
            raise ValueError(f"{bad[0]}: this checkpoint is damaged; resume from an earlier one "
                             "(--resume auto picks the newest intact one)")
        return Path(resume)
    found = checkpoint.list_checkpoints(root)
    for path in reversed(found):
        try:
            _same_settings(path, settings, may_change)
            bad = checkpoint.verify(path)
        except checkpoint.CheckpointError as e:  # (other settings: a ValueError, raised)
            bad = [str(e)]
        if not bad:
            return path
        if os.environ.get("RANK", "0") == "0":  # one line, not one per rank
            print(f"--resume auto: skipping {path.name}, damaged ({bad[0]})", file=sys.stderr)
    if found:
        raise ValueError(f"every checkpoint in {root} is damaged ({len(found)}): delete them, or "
                         "use another --out-dir, to start over")
    return None


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


def make_scaler(args) -> LossScaler:
    """fp16 gets dynamic loss scaling; fp32 and bf16 a disabled (pass-through) scaler."""
    return LossScaler(init_scale=args.loss_scale_init, growth_interval=args.loss_scale_growth_interval,
                      hysteresis=args.loss_scale_hysteresis, enabled=args.precision == "fp16")


