"""Train a GPT with any combination of minidist's techniques, each a flag.

Chapter 01 (chapters/01_gpt.md) is the baseline this runs by default. Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py     # 2 processes
    python minidist/train_gpt.py --steps 50                            # 1 process
    python minidist/train_gpt.py --help
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --precision fp16   # ch. 05
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 minidist/train_gpt.py \
        --checkpoint-every 50 --resume auto                # ch. 08: survives a killed rank
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --pp 2 --grad-accum-steps 4  # ch. 11
    torchrun --standalone --nproc_per_node=4 minidist/train_gpt.py --cp 2 --cp-attention ring  # ch. 12
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --config recipes/cpu_default.toml

On CPU it trains a tiny GPT on Shakespeare with a 2048-token cut of GPT-2's BPE; on a
GPU, GPT-2 small (124M) with GPT-2's full BPE. Every size is a flag. Rank 0 prints one
line per logged step and writes metrics.jsonl, loss.png and summary.json to --out-dir.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import checkpoint, data, metrics
from minidist.checkpoint import faults
from minidist.run import outputs
from minidist.ddp import broadcast_module
from minidist.compose.build import gradient_sync, make_optimizers, make_step, shard_model
from minidist.compose.mesh import make_mesh
from minidist.dist import cleanup, init
from minidist.run.locks import OutDirInUse, acquire_lock, release_lock, take_out_dir
from minidist.run.flag_checks import model_of, moe_of
from minidist.run.flags import (agree_across_ranks, build_parser, make_scaler, optimizer_options, parse_args,
                                resolve_args, world_size_from_env)
from minidist.model import GPT, config_num_params, flops_per_token
from minidist.experts import MoEGPT, expert_stats, moe_flops_per_token, moe_num_params
from minidist.muon import check_routing
from minidist.memory.recompute import set_activation_checkpointing
from minidist.checkpoint.faults import StopOnSignal, any_signal, is_collective_failure
from minidist.train import evaluate, finite_state, lr_at

def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    asked = args.resume  # "auto", a path or None: resolve_args puts the checkpoint found there
    args = resolve_args(args, world_size_from_env())
    # One run per --out-dir: rank 0 holds its lock from here to the end, however it ends
    # (minidist.run.locks.acquire_lock). Every check above ran first: a refused run did nothing.
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        held = acquire_lock(args.out_dir) if rank0 else None
    except OutDirInUse as e:
        build_parser().error(str(e))
    try:
        try:  # another run's outputs there (and checkpoints --resume auto skipped): moved aside, said
            if rank0:
                take_out_dir(args.out_dir, args.resume, asked == "auto")
        except OSError as e:
            build_parser().error(f"--out-dir {args.out_dir}: {e}: fix its permissions, or choose another")
        with StopOnSignal() as stop:
            return _run(args, argv, stop, rank0)
    finally:
        release_lock(held)


def _prepare_data(args, rank0: bool) -> tuple[str, str]:
    """The train and validation shards' globs. The default corpus is tokenized (once) into
    the data cache before the process group exists: each rank does it if needed (writes
    are atomic, so ranks racing on a fresh cache write the same bytes), and a cache found
    damaged is written again."""
    if args.data is not None:
        return args.data, args.val_data
    root = data.default_data_dir(args.tokenizer)
    try:
        data.prepare_shakespeare(root, args.tokenizer, log=print if rank0 else None)
    except (OSError, ValueError, ImportError) as e:
        what = f"{e.strerror} ({e.filename})" if isinstance(e, OSError) and e.strerror else str(e)
        build_parser().error(f"the data cache {root}: {what}: set MINIDIST_DATA to a writable folder, "
                             f"or write it again with python -m minidist.data --tokenizer {args.tokenizer}")
    return f"{root}/train_*.bin", f"{root}/val_*.bin"


def _run(args, argv, stop, rank0) -> dict:
    train_glob, val_glob = _prepare_data(args, rank0)
    info = init(device=args.device)
    try:
        return _train(args, argv, stop, info, train_glob, val_glob)
    finally:
        cleanup()


def _train(args, argv, stop, info, train_glob, val_glob) -> dict:
    agree_across_ranks(vars(args))  # ranks started with different flags fail here, together
    if args.debug_collectives:
        faults.trace_collectives()
    log = print if info.is_main else (lambda *a, **k: None)
    if info.device.type == "cuda":
        # fp32 matmuls on TF32 tensor cores, the rate the MFU peak table assumes for fp32
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(args.seed)

    enc = data.get_tokenizer(args.tokenizer)
    cfg, moe = model_of(args, enc.n_vocab, args.dropout), moe_of(args)  # (moe: chapter 13's experts)
    model = (GPT(cfg) if moe is None else MoEGPT(cfg, moe)).to(info.device)
    n_params = config_num_params(cfg) if moe is None else moe_num_params(cfg, moe)
    broadcast_module(model)  # identical start on every rank, whatever the seeds did
    # chapter 10: the ranks as a dp x tp grid; each replica's tp ranks hold slices of its
    # layers (cut from the identical full model) and share its batch
    # chapter 11: a pp x dp (x tp) grid; each rank holds one stage, its contiguous blocks
    # chapter 12: dp x cp; each replica's cp ranks hold a slice of each of its sequences
    mesh = make_mesh(tp=args.tp, pp=args.pp, cp=args.cp) if max(args.tp, args.pp, args.cp) > 1 else None
    dp, dp_rank, group = (mesh.dp, mesh.dp_rank, mesh.dp_group) if mesh else (info.world_size, info.rank, None)
    model = shard_model(model, mesh, args.sequence_parallel, args.cp_attention, args.cp_layout, args.ep,
                        args.pp_schedule, args.pp_virtual_stages)
    set_activation_checkpointing(model, args.activation_checkpointing == "blocks")  # chapter 09
    opts = make_optimizers(model, group=mesh and mesh.dp_cp_group, **optimizer_options(args))  # (ZeRO, Muon)
    sync = gradient_sync(model, opts, zero_stage=args.zero_stage, dp=args.dp, bucket_cap_mb=args.bucket_cap_mb,
                         mesh=mesh)  # DDP (--dp), the ZeRO optimizer, or a mesh's or a stage's sync
    scaler = make_scaler(args)
    # one step's forward-backward, the evaluation loss and sampling, a plain model's or a stage's
    stepper = make_step(model, sync, scaler, args.precision, dp, group, args.pp_schedule, mesh)
    k = args.grad_accum_steps  # loader step s * k + m is micro-step m of optimizer step s
    train = data.TokenLoader(train_glob, args.seq_len, args.batch_size // k, dp_rank, dp, args.seed)
    val = data.TokenLoader(val_glob, args.seq_len, args.batch_size, dp_rank, dp, args.seed)
    tok_bytes = data.token_bytes(enc)
    fpt = flops_per_token(cfg, args.seq_len) if moe is None else moe_flops_per_token(cfg, moe, args.seq_len)
    dist.barrier()  # on CPU, every rank measures its matmul peak at the same time,
    peak, peak_src = metrics.peak_flops(info.device, args.precision)  # sharing the cores as in training
    log(f"minidist | {info.world_size} x {info.device.type} ({info.backend}) | {args.preset}: "
        f"{n_params / 1e6:.2f}M params, {cfg.n_layer}L {cfg.n_head}H {cfg.n_embd}d, "
        f"vocab {cfg.vocab_size} ({args.tokenizer}) | batch {args.batch_size} x {args.seq_len} "
        f"tokens ({k} micro-step{'s' if k > 1 else ''}) | {_axes(args, dp)} | {args.precision} | {args.optimizer}{f' zero-{args.zero_stage}' if args.zero_stage else ''} | {args.steps} steps | MFU vs {peak_src}")
    for line in (stepper.describe(k), moe and model.describe()):  # (a pipeline's stages, the experts)
        if line:
            log(line)
    if args.plan:  # chapter 09: what the planner chose for the "auto" flags, and why
        log(f"plan | {args.plan}")

    out, start, rows = Path(args.out_dir), 0, []
    if args.resume:  # the step, parameters, optimizer state, scaler and log rows so far
        meta = checkpoint.load(args.resume, model, opts, scaler)
        start, rows = meta["step"], meta["extra"]["rows"]
        if not meta["rng_restored"]:  # another world size: fresh RNG streams, reproducibly
            torch.manual_seed(args.seed + start)
        log(f"resumed from {args.resume} at step {start} (saved by {meta['world_size']} ranks)")
    if info.is_main:  # the run's first write here: from now on summary.json says it is running
        outputs.mark_running(out, vars(args))
    rows = outputs.MetricsFile(out / "metrics.jsonl", rows, write=info.is_main)  # appended as it goes
    run = outputs.Ending(args, argv, info.world_size, info.is_main, rows,
                         good=Path(args.resume) if args.resume else None)

    def facts() -> dict:  # for summary.json, however the run ends
        return {"skipped_steps": scaler.skipped_steps, "loss_scale": scaler.get_scale(),
                "device": info.device.type, "params": n_params}
    watch = outputs.LossWatch(args)  # a loss non-finite for steps in a row stops the run
    tput, t_start = metrics.Throughput(), time.perf_counter()
    check_muon_routing = args.optimizer == "muon"  # once, after the first step taken (ch. 07)
    loss, step = math.nan, start - 1
    try:
        for step in range(start, args.steps):
            lr = lr_at(step, args.lr, args.warmup_steps, args.steps, args.min_lr_ratio)
            for g in (g for o in opts for g in o.param_groups):
                g["lr"] = g["peak_lr"] * lr / args.lr  # every group on the same schedule
            micro = [tuple(t.to(info.device) for t in train.batch(step * k + m)) for m in range(k)]
            loss = stepper.forward_backward(micro)
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
            diverged = None
            try:  # the loss is all-reduced: every rank decides alike
                watch.check(step + 1, loss)
            except outputs.NonFiniteLoss as e:
                diverged = str(e)
            signum = any_signal(stop.signum)  # every rank stops at the same step
            tput.add(args.batch_size * args.seq_len)

            last = step == args.steps - 1
            ending = diverged is not None or bool(signum)
            if step == 0 or last or ending or (step + 1) % args.log_interval == 0 or \
                    (step + 1) % args.eval_interval == 0:
                row = {"step": step + 1, "loss": loss, "lr": lr}
                if moe:  # the last micro-step's choices per expert and drops, per MoE block (not evaluation's)
                    row["experts"] = expert_stats(model)
                if scaler.enabled:
                    row.update(loss_scale=scaler.get_scale(), skipped_steps=scaler.skipped_steps)
                rate = tput.rate()  # training only: evaluation below is not counted
                if (step + 1) % args.eval_interval == 0 and not (last or ending):
                    row["val_loss"], _ = evaluate(model, val, info, tok_bytes, args.eval_windows,
                                                  args.precision, group, stepper.loss_sum)
                    tput.rate()  # restart the clock after evaluating
                m = metrics.mfu(fpt, rate, peak, info.world_size)
                row.update(tokens_per_s=rate, mfu=m, mem_gb=metrics.memory_bytes(info.device) / 1e9,
                           elapsed_s=time.perf_counter() - t_start)
                rows.append(row)
                log(f"step {step + 1:5d}/{args.steps} | loss {row['loss']:.4f}"
                    + (f" | val {row['val_loss']:.4f}" if "val_loss" in row else "")
                    + f" | lr {lr:.2e}"
                    + (f" | scale {scaler.get_scale():g} ({scaler.skipped_steps} skipped)" if scaler.enabled else "")
                    + f" | {rate:,.0f} tok/s | MFU {metrics.mfu_text(m)}"
                    + f" | mem {row['mem_gb']:.2f} GB" + (f" | experts {row['experts']}" if moe else ""))
            if args.checkpoint_every and diverged is None and \
                    ((step + 1) % args.checkpoint_every == 0 or last or ending):  # (a signal: saved)
                run.save(step + 1, loss, model, opts, scaler, cfg, args, facts)
            faults.inject_fault("step", step + 1, info.rank)
            if diverged is not None:
                run.stop("diverged", f"stopped: {diverged}", step + 1, facts(), since=watch.since)
            if signum:
                run.stop("interrupted", f"stopped at step {step + 1} by {signal.Signals(signum).name}",
                         step + 1, facts(), exit_code=128 + signum)
        # a loss or weights that turned non-finite in the last steps, too few to stop the
        # run: it ends diverged (no checkpoint was written from them), not with val loss nan
        if step >= start and not (math.isfinite(loss) and finite_state(model, opts, scaler)):
            since = watch.since or step + 1
            run.stop("diverged", f"the run diverged: the {'loss' if watch.since else 'model'} became "
                     f"non-finite at step {since} and stayed so to the last step, {step + 1}",
                     step + 1, facts(), since=since)
        signum = any_signal(stop.signum)  # asked to stop as the training ended: no final evaluation
        if signum:
            run.stop("interrupted", f"stopped after the last step, {step + 1}, by "
                     f"{signal.Signals(signum).name}, before the final evaluation", step + 1,
                     facts(), exit_code=128 + signum)
    except outputs.RunStopped:
        rows.close()
        raise
    except Exception as e:  # a rank lost, a collective that timed out, an error here
        if mesh is not None and is_collective_failure(e):  # gloo's words name no rank or group
            e = RuntimeError(f"{mesh.where()}: {e}")
        run.failed(e, step + 1, facts(), collective=is_collective_failure(e))
        rows.close()
        if is_collective_failure(e):  # a consequence: the rank that failed says why
            raise outputs.RunStopped(str(e)) from e
        raise

    # by default the whole validation split
    val_loss, bpb = evaluate(model, val, info, tok_bytes, args.final_eval_windows, args.precision, group,
                             stepper.loss_sum)
    train_s = time.perf_counter() - t_start
    rows.append({"step": args.steps, "val_loss": val_loss, "val_bpb": bpb})
    summary = {"ended": "completed", "val_loss": val_loss, "val_bpb": bpb, "train_seconds": train_s,
               "skipped_steps": scaler.skipped_steps, "loss_scale": scaler.get_scale(),
               "world_size": info.world_size, "device": info.device.type,
               "params": n_params, "config": cfg.to_dict(), "moe": moe and moe.to_dict(), "args": vars(args),
               "checkpoint": run.good and str(run.good)}
    # every rank samples (the same text, same seed): under ZeRO-3 each forward is collective
    g = torch.Generator(device=info.device).manual_seed(args.seed)
    prompt = torch.tensor([[enc.eot_token]], device=info.device)
    summary["sample"] = sample = enc.decode(stepper.generate(
        prompt, args.sample_tokens, temperature=0.8, top_k=50, generator=g)[0, 1:].tolist())
    if info.is_main:  # summary.json (NaN: null) and loss.png, each whole or not at all
        note = run.write(summary)
        log(f"final | val loss {val_loss:.4f} nats/token | {bpb:.3f} bits/byte | "
            f"trained {train_s:.0f}s\n--- sample ---\n{sample}\n--- "
            f"metrics.jsonl, loss.png, summary.json in {out}/{note}")
    return {**summary, "rows": list(rows)}  # plain rows: the file behind them is closed


def _axes(args, dp: int) -> str:
    """The mesh for the log: "dp flat x 2, tp 2 + sequence parallel, pp 2"."""
    out = f"dp {args.dp if (args.pp == 1 and not args.n_experts) or args.dp == 'naive' else 'flat'}"
    if args.tp > 1 or args.pp > 1 or args.cp > 1:
        out += f" x {dp}"
    if args.n_experts:
        out += f", ep {args.ep} (ExpertSync: experts summed over their replicas)"
    if args.cp > 1:
        out += f", cp {args.cp} ({args.cp_attention}, {args.cp_layout})"
    if args.tp > 1:
        out += f", tp {args.tp}" + (" + sequence parallel" if args.sequence_parallel else "")
    return out + (f", pp {args.pp}" if args.pp > 1 else "")


if __name__ == "__main__":
    try:
        main()
    except outputs.RunStopped as e:  # its line is printed (rank 0) and summary.json written
        sys.exit(e.exit_code)
