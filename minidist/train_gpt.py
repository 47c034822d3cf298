"""Train a GPT with any combination of minidist's techniques, each a flag.

Chapter 01 (chapters/01_gpt.md) is the baseline this runs by default. Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py     # 2 processes
    python minidist/train_gpt.py --steps 50                            # 1 process
    python minidist/train_gpt.py --help
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --precision fp16   # ch. 05

On CPU it trains a tiny GPT on Shakespeare with a 2048-token cut of GPT-2's BPE; on a
GPU, GPT-2 small (124M) with GPT-2's full BPE. Every size is a flag. Rank 0 prints one
line per logged step and writes metrics.jsonl, loss.png and summary.json to --out-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import data, metrics
from minidist.ddp import DDP, allreduce_gradients_flat, allreduce_gradients_naive, broadcast_module
from minidist.dist import cleanup, init
from minidist.muon import Muon, split_params
from minidist.model import GPT, PRESETS, GPTConfig, flops_per_token, num_params
from minidist.scaler import LossScaler, autocast
from minidist.zero3 import zero_optimizer

# What "auto" means on each kind of device: a run that fits the machine.
AUTO = {
    "cpu": dict(preset="tiny", tokenizer="gpt2-2048", batch_size=32, steps=480, lr=3e-3,
                warmup_steps=20, eval_interval=80, log_interval=20),
    "cuda": dict(preset="gpt2", tokenizer="gpt2", batch_size=32, steps=300, lr=6e-4,
                 warmup_steps=30, eval_interval=50, log_interval=10),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
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
    a("--optimizer", default="adamw", choices=["adamw", "muon"],
      help="muon: Muon for the hidden matrices (shared across ranks), AdamW for the rest")
    a("--muon-lr", type=float, default=0.02, help="Muon's peak learning rate (same schedule)")
    a("--muon-momentum", type=float, default=0.95)
    a("--muon-weight-decay", type=float, default=0.0)
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
    a("--bucket-cap-mb", type=float, default=25.0, help="bucket size for --dp bucketed")
    a("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
      help="ZeRO: 1 shards AdamW's state over ranks, 2 also the gradients (reduce-scattered "
           "during backward), 3 also the parameters (gathered per block, prefetched); 0 is "
           "plain data parallelism (--dp)")
    a("--grad-accum-steps", type=int, default=1,
      help="micro-steps per optimizer step; --batch-size is split over ranks and micro-steps")
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
    return p


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
    if args.seq_len is None:
        args.seq_len = PRESETS[args.preset]["block_size"]
    for k in ("batch_size", "steps", "seq_len", "eval_interval", "log_interval", "eval_windows",
              "final_eval_windows"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        p.error(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
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
    if args.zero_stage and args.optimizer == "muon":
        p.error("--optimizer muon with --zero-stage > 0: Muon needs each gradient matrix whole "
                "and already shards its own momentum over ranks; use --zero-stage 0 with muon")
    if bool(args.data) != bool(args.val_data):
        p.error("--data and --val-data go together: give both or neither")
    try:
        data.get_tokenizer(args.tokenizer)
        if args.data is None:
            data.corpus_dir()
        else:
            for pattern in (args.data, args.val_data):
                data.TokenLoader(pattern, args.seq_len, world_size, 0, world_size)  # reads headers
    except (ValueError, ImportError, FileNotFoundError) as e:
        p.error(str(e))
    return args


def make_scaler(args) -> LossScaler:
    """fp16 gets dynamic loss scaling; fp32 and bf16 a disabled (pass-through) scaler."""
    return LossScaler(init_scale=args.loss_scale_init, growth_interval=args.loss_scale_growth_interval,
                      hysteresis=args.loss_scale_hysteresis, enabled=args.precision == "fp16")


def make_optimizers(model, args) -> list[torch.optim.Optimizer]:
    """AdamW (weight decay on matrices only), sharded by ZeRO when asked; or Muon for the
    hidden matrices plus AdamW for embeddings, head, gains and biases. Each group
    remembers its peak lr."""
    hidden, rest = split_params(model) if args.optimizer == "muon" else ([], list(model.parameters()))
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if args.zero_stage:  # ZeRO averages the gradients itself, with reduce-scatters
        opts = [zero_optimizer(model, groups, torch.optim.AdamW, args.zero_stage,
                               bucket_cap_mb=args.bucket_cap_mb, **adamw)]
    else:
        opts = [torch.optim.AdamW(groups, **adamw)]
    if hidden:
        opts.append(Muon(hidden, lr=args.muon_lr, momentum=args.muon_momentum,
                         weight_decay=args.muon_weight_decay))
    for g in (g for o in opts for g in o.param_groups):
        g["peak_lr"] = g["lr"]
    return opts


def forward_backward(model, micro_batches, world_size: int, ddp: DDP | None = None,
                     scaler: LossScaler | None = None, precision: str = "fp32") -> float:
    """Gradients of one optimizer step over this rank's micro-batches; returns the loss.

    The loss is normalised by the number of target tokens in the whole global batch (all
    micro-steps, all ranks; targets of -1 are masked and do not count), so every token
    weighs the same however the tokens fall across micro-batches and ranks. Gradient
    averaging divides by world_size, so each rank scales its summed loss by world_size /
    global_tokens. Under DDP, all micro-steps but the last run in no_sync(): no
    communication until the gradients are complete. The forward pass runs under autocast
    at `precision`; with a scaler, the loss is multiplied by its scale before backward.
    """
    # tokens in the global batch: one tiny collective per step (float64: exact counts)
    count = sum((y != -1).sum() for _, y in micro_batches).double().reshape(1)
    dist.all_reduce(count)
    if count.item() == 0:
        raise ValueError("every target in this global batch is masked (-1): nothing to learn from")
    total = torch.zeros((), dtype=torch.float64, device=count.device)
    for i, (x, y) in enumerate(micro_batches):
        sync = ddp is None or i == len(micro_batches) - 1
        with (contextlib.nullcontext() if sync else ddp.no_sync()):
            with autocast(x.device, precision):
                _, loss_sum = model(x, y, reduction="sum")  # fp32: autocast reduces in fp32
            loss = loss_sum.float() * (world_size / count.item())
            (scaler.scale(loss) if scaler else loss).backward()
        total += loss_sum.detach().double()
    dist.all_reduce(total)  # for the log: the global batch's mean loss per token
    return (total / count).item()


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - 1 - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    args = resolve_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    # Data is prepared before the process group exists: each rank tokenizes if needed
    # (writes are atomic, so ranks racing on a fresh cache write the same bytes).
    if args.data is None:
        root = data.default_data_dir(args.tokenizer)
        data.prepare_shakespeare(root, args.tokenizer)
        args.data, args.val_data = f"{root}/train_*.bin", f"{root}/val_*.bin"
    info = init(device=args.device)
    log = print if info.is_main else (lambda *a, **k: None)
    if info.device.type == "cuda":
        # fp32 matmuls on TF32 tensor cores, the rate the MFU peak table assumes for fp32
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(args.seed)

    enc = data.get_tokenizer(args.tokenizer)
    cfg = GPTConfig(**{**PRESETS[args.preset], "block_size": args.seq_len,
                       "vocab_size": enc.n_vocab, "dropout": args.dropout,
                       **{k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd")
                          if getattr(args, k) is not None}})
    model = GPT(cfg).to(info.device)
    broadcast_module(model)  # identical start on every rank, whatever the seeds did
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb) if args.dp == "bucketed" and not args.zero_stage else None
    opts = make_optimizers(model, args)
    zero = opts[0] if args.zero_stage else None  # it also plays DDP's part: no_sync, averaging
    scaler = make_scaler(args)
    k = args.grad_accum_steps  # loader step s * k + m is micro-step m of optimizer step s
    train = data.TokenLoader(args.data, args.seq_len, args.batch_size // k, info.rank,
                             info.world_size, args.seed)
    val = data.TokenLoader(args.val_data, args.seq_len, args.batch_size, info.rank,
                           info.world_size, args.seed)
    tok_bytes = data.token_bytes(enc)
    fpt = flops_per_token(cfg, args.seq_len)
    dist.barrier()  # on CPU, every rank measures its matmul peak at the same time,
    peak, peak_src = metrics.peak_flops(info.device, args.precision)  # sharing the cores as in training
    log(f"minidist | {info.world_size} x {info.device.type} ({info.backend}) | {args.preset}: "
        f"{num_params(model) / 1e6:.2f}M params, {cfg.n_layer}L {cfg.n_head}H {cfg.n_embd}d, "
        f"vocab {cfg.vocab_size} ({args.tokenizer}) | batch {args.batch_size} x {args.seq_len} "
        f"tokens ({k} micro-step{'s' if k > 1 else ''}) | dp {args.dp} | {args.precision} | {args.optimizer}{f' zero-{args.zero_stage}' if args.zero_stage else ''} | {args.steps} steps | MFU vs {peak_src}")

    out = Path(args.out_dir)
    rows, tput, t_start = [], metrics.Throughput(), time.perf_counter()
    for step in range(args.steps):
        lr = lr_at(step, args)
        for g in (g for o in opts for g in o.param_groups):
            g["lr"] = g["peak_lr"] * lr / args.lr  # every group on the same schedule
        micro = [tuple(t.to(info.device) for t in train.batch(step * k + m)) for m in range(k)]
        loss = forward_backward(ddp or model, micro, info.world_size, ddp or zero, scaler, args.precision)
        if ddp is None and zero is None:  # DDP and ZeRO have averaged during backward
            (allreduce_gradients_flat if args.dp == "flat" else allreduce_gradients_naive)(model)
        for o in opts:
            scaler.unscale_(o)  # true gradients before clipping (a no-op unless fp16)
        if args.grad_clip > 0:  # ZeRO: the norm of the whole gradient, from the shards
            (zero.clip_grad_norm_ if zero else lambda c: torch.nn.utils.clip_grad_norm_(
                model.parameters(), c))(args.grad_clip)
        for o in opts:
            scaler.step(o)  # skipped if a gradient overflowed on any rank
            o.zero_grad(set_to_none=True)
        scaler.update()
        tput.add(args.batch_size * args.seq_len)

        last = step == args.steps - 1
        if step == 0 or last or (step + 1) % args.log_interval == 0 or (step + 1) % args.eval_interval == 0:
            row = {"step": step + 1, "loss": loss, "lr": lr}
            if scaler.enabled:
                row.update(loss_scale=scaler.get_scale(), skipped_steps=scaler.skipped_steps)
            rate = tput.rate()  # training only: evaluation below is not counted
            if (step + 1) % args.eval_interval == 0 and not last:
                row["val_loss"], _ = metrics.evaluate(model, val, info, tok_bytes, args.eval_windows,
                                              args.precision)
                tput.rate()  # restart the clock after evaluating
            m = metrics.mfu(fpt, rate, peak, info.world_size)
            row.update(tokens_per_s=rate, mfu=m, mem_gb=metrics.memory_bytes(info.device) / 1e9,
                       elapsed_s=time.perf_counter() - t_start)
            rows.append(row)
            log(f"step {step + 1:5d}/{args.steps} | loss {row['loss']:.4f}"
                + (f" | val {row['val_loss']:.4f}" if "val_loss" in row else "")
                + f" | lr {lr:.2e}"
                + (f" | scale {scaler.get_scale():g} ({scaler.skipped_steps} skipped)" if scaler.enabled else "")
                + f" | {rate:,.0f} tok/s | MFU "
                + (f"{100 * m:.1f}%" if m is not None else "n/a")
                + f" | mem {row['mem_gb']:.2f} GB")

    # by default the whole validation split
    val_loss, bpb = metrics.evaluate(model, val, info, tok_bytes, args.final_eval_windows, args.precision)
    train_s = time.perf_counter() - t_start
    rows.append({"step": args.steps, "val_loss": val_loss, "val_bpb": bpb})
    summary = {"val_loss": val_loss, "val_bpb": bpb, "train_seconds": train_s,
               "skipped_steps": scaler.skipped_steps, "loss_scale": scaler.get_scale(),
               "world_size": info.world_size, "device": info.device.type,
               "params": num_params(model), "config": cfg.to_dict(), "args": vars(args)}
    # every rank samples (the same text, same seed): under ZeRO-3 each forward is collective
    g = torch.Generator(device=info.device).manual_seed(args.seed)
    prompt = torch.tensor([[enc.eot_token]], device=info.device)
    summary["sample"] = sample = enc.decode(model.generate(
        prompt, args.sample_tokens, temperature=0.8, top_k=50, generator=g)[0, 1:].tolist())
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        metrics.plot_losses(rows, out / "loss.png")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        log(f"final | val loss {val_loss:.4f} nats/token | {bpb:.3f} bits/byte | "
            f"trained {train_s:.0f}s\n--- sample ---\n{sample}\n--- "
            f"metrics.jsonl, loss.png, summary.json in {out}/")
    cleanup()
    return {**summary, "rows": rows}


if __name__ == "__main__":
    sys.exit(main() and 0)
