"""Train a GPT with any combination of minidist's techniques, each a flag.

Chapter 01 (chapters/01_gpt.md) is the baseline this runs by default. Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py     # 2 processes
    python minidist/train_gpt.py --steps 50                            # 1 process
    python minidist/train_gpt.py --help
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --precision fp16   # ch. 05
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 minidist/train_gpt.py \
        --checkpoint-every 50 --resume auto                # ch. 08: survives a killed rank

On CPU it trains a tiny GPT on Shakespeare with a 2048-token cut of GPT-2's BPE; on a
GPU, GPT-2 small (124M) with GPT-2's full BPE. Every size is a flag. Rank 0 prints one
line per logged step and writes metrics.jsonl, loss.png and summary.json to --out-dir.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import checkpoint, data, faults, metrics
from minidist.ddp import broadcast_module
from minidist.dist import cleanup, init
from minidist.flags import agree_across_ranks, build_parser, make_scaler, resolve_args
from minidist.model import GPT, PRESETS, GPTConfig, flops_per_token, num_params
from minidist.muon import check_routing
from minidist.recompute import set_activation_checkpointing
from minidist.train import evaluate, forward_backward, gradient_sync, lr_at, make_optimizers


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    args = resolve_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    # Data is prepared before the process group exists: each rank tokenizes if needed
    # (writes are atomic, so ranks racing on a fresh cache write the same bytes).
    train_glob, val_glob = args.data, args.val_data
    if args.data is None:
        root = data.default_data_dir(args.tokenizer)
        data.prepare_shakespeare(root, args.tokenizer)
        train_glob, val_glob = f"{root}/train_*.bin", f"{root}/val_*.bin"
    info = init(device=args.device)
    agree_across_ranks(vars(args))  # ranks started with different flags fail here, together
    if args.debug_collectives:
        faults.trace_collectives()
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
    set_activation_checkpointing(model, args.activation_checkpointing == "blocks")  # chapter 09
    broadcast_module(model)  # identical start on every rank, whatever the seeds did
    opts = make_optimizers(model, args)
    sync = gradient_sync(model, opts, args)  # DDP (--dp), or the ZeRO optimizer: averages gradients
    scaler = make_scaler(args)
    k = args.grad_accum_steps  # loader step s * k + m is micro-step m of optimizer step s
    train = data.TokenLoader(train_glob, args.seq_len, args.batch_size // k, info.rank,
                             info.world_size, args.seed)
    val = data.TokenLoader(val_glob, args.seq_len, args.batch_size, info.rank,
                           info.world_size, args.seed)
    tok_bytes = data.token_bytes(enc)
    fpt = flops_per_token(cfg, args.seq_len)
    dist.barrier()  # on CPU, every rank measures its matmul peak at the same time,
    peak, peak_src = metrics.peak_flops(info.device, args.precision)  # sharing the cores as in training
    log(f"minidist | {info.world_size} x {info.device.type} ({info.backend}) | {args.preset}: "
        f"{num_params(model) / 1e6:.2f}M params, {cfg.n_layer}L {cfg.n_head}H {cfg.n_embd}d, "
        f"vocab {cfg.vocab_size} ({args.tokenizer}) | batch {args.batch_size} x {args.seq_len} "
        f"tokens ({k} micro-step{'s' if k > 1 else ''}) | dp {args.dp} | {args.precision} | {args.optimizer}{f' zero-{args.zero_stage}' if args.zero_stage else ''} | {args.steps} steps | MFU vs {peak_src}")
    if args.plan:  # chapter 09: what the planner chose for the "auto" flags, and why
        log(f"plan | {args.plan}")

    out, start, rows = Path(args.out_dir), 0, []
    if args.resume:  # the step, parameters, optimizer state, scaler and log rows so far
        meta = checkpoint.load(args.resume, model, opts, scaler)
        start, rows = meta["step"], meta["extra"]["rows"]
        if not meta["rng_restored"]:  # another world size: fresh RNG streams, reproducibly
            torch.manual_seed(args.seed + start)
        log(f"resumed from {args.resume} at step {start} (saved by {meta['world_size']} ranks)")
    rows = metrics.MetricsFile(out / "metrics.jsonl", rows, write=info.is_main)  # appended as it goes
    watch = metrics.LossWatch(args)  # a loss non-finite for steps in a row stops the run
    tput, t_start = metrics.Throughput(), time.perf_counter()
    check_muon_routing = args.optimizer == "muon"  # once, after the first step taken (ch. 07)
    for step in range(start, args.steps):
        lr = lr_at(step, args)
        for g in (g for o in opts for g in o.param_groups):
            g["lr"] = g["peak_lr"] * lr / args.lr  # every group on the same schedule
        micro = [tuple(t.to(info.device) for t in train.batch(step * k + m)) for m in range(k)]
        loss = forward_backward(model, micro, info.world_size, sync, scaler, args.precision)
        for o in opts:  # the gradients are averaged now
            scaler.unscale_(o)  # true gradients before clipping (a no-op unless fp16)
        if args.grad_clip > 0:
            sync.clip_grad_norm_(args.grad_clip)  # the norm of the whole averaged gradient
        for o in opts:
            scaler.step(o)  # skipped if a gradient overflowed on any rank
            o.zero_grad(set_to_none=True)
        scaler.update()
        if check_muon_routing and not scaler.last_step_skipped:
            check_routing(model, opts)  # each hidden matrix stepped by Muon, nothing else by it
            check_muon_routing = False
        watch.check(step + 1, loss)
        tput.add(args.batch_size * args.seq_len)

        last = step == args.steps - 1
        if step == 0 or last or (step + 1) % args.log_interval == 0 or (step + 1) % args.eval_interval == 0:
            row = {"step": step + 1, "loss": loss, "lr": lr}
            if scaler.enabled:
                row.update(loss_scale=scaler.get_scale(), skipped_steps=scaler.skipped_steps)
            rate = tput.rate()  # training only: evaluation below is not counted
            if (step + 1) % args.eval_interval == 0 and not last:
                row["val_loss"], _ = evaluate(model, val, info, tok_bytes, args.eval_windows,
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
        if args.checkpoint_every and ((step + 1) % args.checkpoint_every == 0 or last):
            checkpoint.save(out / "checkpoints", step + 1, model, opts, scaler, keep=args.keep_checkpoints,
                            extra={"settings": vars(args), "rows": rows, "config": cfg.to_dict()})
        faults.inject_fault("step", step + 1, info.rank)

    # by default the whole validation split
    val_loss, bpb = evaluate(model, val, info, tok_bytes, args.final_eval_windows, args.precision)
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
        rows.close()
        metrics.plot_losses(rows, out / "loss.png")
        (out / "summary.json").write_text(metrics.to_json(summary, indent=1))  # NaN: null
        log(f"final | val loss {val_loss:.4f} nats/token | {bpb:.3f} bits/byte | "
            f"trained {train_s:.0f}s\n--- sample ---\n{sample}\n--- "
            f"metrics.jsonl, loss.png, summary.json in {out}/")
    cleanup()
    return {**summary, "rows": list(rows)}  # plain rows: the file behind them is closed


if __name__ == "__main__":
    sys.exit(main() and 0)
