"""`python -m minidist.bench ddp`: a data-parallel training step, minidist's naive, flat
and bucketed DDP against torch's DistributedDataParallel. Chapter 03
(chapters/03_data_parallel.md). Exercised by `python -m minidist.bench ddp --quick`.

train_gpt's CPU default model on 2 ranks, variants interleaved in short rounds; bucketed DDP
at several caps (0: one bucket per parameter; None: one for everything) and once without
overlap; `no_comm` sends nothing, so a step minus no_comm is the communication left exposed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.bench import cpu_default, rank_device
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import interleaved
from minidist.ddp import DDP, allreduce_gradients_flat, allreduce_gradients_naive
from minidist.run.flags import AUTO
from minidist.launch import launch
from minidist.model import GPT, GPTConfig


def _time_ddp(variants, steps, rounds, cfg_kw, per_rank_batch, seq_len):
    """Per variant, the median step time (forward, backward, sync, AdamW step) on the same
    model and data; variants interleaved in rounds so drift in machine load hits all."""
    device = rank_device()
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    x = torch.randint(0, cfg.vocab_size, (per_rank_batch, seq_len), device=device)
    runners = {}
    for name in variants:
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        post, ctx = (lambda: None), contextlib.nullcontext
        if name == "torch_ddp":
            fwd = torch.nn.parallel.DistributedDataParallel(model)
        elif name.startswith("bucketed"):  # bucketed:<cap MB|None>[:no_overlap]
            parts = name.split(":")
            cap = None if parts[1] == "None" else float(parts[1])
            fwd = DDP(model, bucket_cap_mb=cap, overlap=len(parts) < 3)
        else:
            fwd = model
            post = {"naive": lambda m=model: allreduce_gradients_naive(m),
                    "flat": lambda m=model: allreduce_gradients_flat(m)}.get(name, post)
            if name == "no_comm":  # compute only: what a step costs with nothing to send
                ctx = DDP(model).no_sync
        runners[name] = (fwd, opt, post, ctx)

    def step(name):
        fwd, opt, post, ctx = runners[name]
        with ctx():
            fwd(x, x)[1].backward()
        post()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = interleaved({n: (lambda n=n: step(n)) for n in variants}, rounds, steps, before=lambda n: dist.barrier())
    return {n: m.median for n, m in t.items()} if dist.get_rank() == 0 else None


def run(args) -> dict:
    cfg_kw = cpu_default(quick=False)[0]  # train_gpt's CPU default model
    world, steps, rounds = 2, 2, 12  # many short rounds: load drifts hit every variant alike
    global_batch, seq_len = AUTO["cpu"]["batch_size"], cfg_kw["block_size"]
    caps = ["0", "0.25", "0.5", "1", "2", "None"]
    if args.quick:
        cfg_kw.update(n_layer=2, n_embd=64, n_head=2)
        steps, rounds, caps = 1, 1, ["0", "1", "None"]
    variants = (["naive", "flat", "torch_ddp", "no_comm", "bucketed:1:no_overlap"]
                + [f"bucketed:{c}" for c in caps])
    t = launch(_time_ddp, world, variants, steps, rounds, cfg_kw, global_batch // world, seq_len,
               timeout_s=300, device="auto")[0]  # (its tensors on the device its backend implies)
    best = min(caps, key=lambda c: t[f"bucketed:{c}"])
    exposed = {"without overlap": t["bucketed:1:no_overlap"] - t["no_comm"],
               "with overlap": t["bucketed:1"] - t["no_comm"]}
    hidden = 1 - exposed["with overlap"] / exposed["without overlap"] if exposed["without overlap"] > 0 else None
    print(f"default GPT (tiny, vocab 2048), {world} ranks, {global_batch} x {seq_len} tokens per step; "
          f"median of {rounds} rounds x {steps} steps")
    print(f"{'variant':26} {'step ms':>8} {'vs torch DDP':>12}")
    for n in variants:
        print(f"{n:26} {1e3 * t[n]:8.1f} {t[n] / t['torch_ddp']:12.3f}")
    print(f"best bucket cap: {best} MB ({t[f'bucketed:{best}'] / t['torch_ddp']:.3f}x torch DDP); "
          f"communication exposed: {1e3 * exposed['without overlap']:.1f} ms without overlap, "
          f"{1e3 * exposed['with overlap']:.1f} ms with (1 MB buckets)"
          + (f": {100 * hidden:.0f}% hidden behind backward" if hidden is not None and hidden >= 0 else
             ": none hidden (the overlapped run was the slower one: noise)" if hidden is not None else ""))
    result = {"step_s": t, "best_cap_mb": best, "exposed_comm_s": exposed, "hidden_fraction": hidden,
              "ratio_vs_torch_ddp": {n: t[n] / t["torch_ddp"] for n in variants}}
    _plot_ddp(t, caps, Path(args.out) / "ddp.png")
    return result


def _plot_ddp(t, caps, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [0.05 if c == "0" else 8.0 if c == "None" else float(c) for c in caps]
    ax.plot(xs, [1e3 * t[f"bucketed:{c}"] for c in caps], "o-", label="minidist DDP (bucketed)")
    for n, style in (("torch_ddp", "--"), ("naive", ":"), ("flat", "-."), ("no_comm", "-")):
        ax.axhline(1e3 * t[n], ls=style, color="gray" if n == "no_comm" else None, label=n)
    ax.set(xscale="log", xlabel="bucket cap (MB; left: one per parameter, right: one bucket)",
           ylabel="step time (ms)", title="data parallel step time, 2 ranks")
    ax.legend(fontsize=8), ax.grid(alpha=0.3)
    save_figure(fig, path)
