"""`python -m minidist.bench muon`: what Muon costs and what it buys. Chapter 07
(chapters/07_muon.md). Exercised by `python -m minidist.bench muon --quick`
(tests/test_bench.py).

1. Newton-Schulz against matrix size, ours beside torch.optim.Muon's, and Muon's step against
   forward+backward, beside Keller Jordan's estimate (about 5 m / tokens-per-step);
2. distributed Muon's step at 1, 2 and 4 ranks, one thread per rank;
3. Muon against AdamW on the embedded corpus, three learning rates each: the steps Muon
   needs to reach AdamW's best final validation loss;
4. Muon under ZeRO stages 0-3 against AdamW at the same stage (minidist/bench/muon_zero.py).

`python -m minidist.bench.muon` measures Newton-Schulz alone (chapter 07, section 2).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.bench import muon_zero
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import interleaved, measure
from minidist.cost_model import ns_flops
from minidist.run.flags import AUTO
from minidist.launch import launch
from minidist.model import GPT, PRESETS, GPTConfig
from minidist.muon import Muon, newton_schulz, newton_schulz_many, split_params


def _ns_sizes(quick: bool, device):
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns  # torch's, as oracle
    sizes = [(128, 512), (256, 1024)] if quick else [(128, 512), (256, 1024), (512, 2048),
                                                     (768, 3072), (1024, 4096)]
    rows = []
    for m, n in sizes:
        G = torch.randn(m, n, device=device)
        ours = measure(lambda: newton_schulz(G), 1 if quick else 9).median
        theirs = measure(lambda: torch_ns(G, (3.4445, -4.7750, 2.0315), 5, 1e-7), 1 if quick else 9).median
        fp32 = measure(lambda: newton_schulz(G, dtype=torch.float32), 1 if quick else 9).median
        rows.append(dict(m=m, n=n, ours_bf16_s=ours, torch_bf16_s=theirs, ours_fp32_s=fp32,
                         ratio=ours / theirs, bf16_tflops=ns_flops(m, n) / ours / 1e12))
    return rows


def _model_cfg(quick: bool, device) -> tuple[dict, int, int]:
    """train_gpt's default model for the device (tiny on CPU, GPT-2 on GPU), its batch."""
    auto = AUTO[device.type]
    vocab = 50257 if auto["tokenizer"] == "gpt2" else int(auto["tokenizer"].split("-")[1])
    cfg = dict(PRESETS[auto["preset"]], vocab_size=vocab)
    batch = auto["batch_size"]
    if quick:
        cfg.update(n_layer=2, n_embd=64, n_head=2)
        batch = 4
    return cfg, batch, cfg["block_size"]


def _step_vs_train(quick: bool, device) -> dict:
    """Muon's step beside forward+backward of the same model and batch, one process."""
    cfg, batch, T = _model_cfg(quick, device)
    model = GPT(GPTConfig(**cfg)).to(device)
    hidden, _ = split_params(model)
    x = torch.randint(0, cfg["vocab_size"], (batch, T), device=device)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        model(x, x)[1].backward()
    fwd_bwd()
    opt = Muon(hidden, lr=1e-4)
    t_train = measure(fwd_bwd, 1 if quick else 7).median
    t_step = measure(opt.step, 1 if quick else 7).median
    params = sum(p.numel() for p in model.parameters())
    flops_ns = sum(ns_flops(*p.shape) for p in hidden)
    flops_train = 6 * params * batch * T
    return dict(muon_step_s=t_step, fwd_bwd_s=t_train, time_fraction=t_step / t_train,
                flop_fraction=flops_ns / flops_train, keller_estimate=5 * cfg["n_embd"] / (batch * T),
                tokens_per_step=batch * T, config=cfg)


def _distributed_step(cfg: dict, repeat: int) -> float | None:
    """Median Muon step time on this rank count; one thread per rank."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    hidden, _ = split_params(model)
    for p in hidden:
        p.grad = torch.randn_like(p)
    opt = Muon(hidden, lr=1e-4)
    # the barrier inside the timed call, as this table has always measured it: a step
    # here is "all ranks met, then each stepped"
    t = measure(lambda: (dist.barrier(), opt.step()), repeat).median
    return t if dist.get_rank() == 0 else None


def _train(argv: list[str], out_dir: Path) -> list[dict]:
    """One run of the training entry point, as a user starts it (one process, no
    torchrun); its logged rows, from the metrics.jsonl it writes."""
    root = Path(__file__).resolve().parents[2]  # the folder that holds minidist/
    cmd = [sys.executable, "-m", "minidist.train_gpt", *argv, "--out-dir", str(out_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _train_curves(quick: bool, out: Path) -> dict:
    """Muon vs AdamW, each at three learning rates, same model, data and steps."""
    steps, evals = (4, 2) if quick else (300, 20)  # --quick: two points of each curve
    common = ["--device", "cpu", "--steps", str(steps), "--eval-interval", str(evals),
              "--log-interval", str(evals), "--sample-tokens", "0", "--warmup-steps", "2" if quick else "20"]
    windows = ["--eval-windows", "16" if quick else "256", "--final-eval-windows", "16" if quick else "256"]
    if quick:
        common += ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--batch-size", "8", "--seq-len", "32"]
    todo = [(name, lr, flag) for name, lrs, flag in (("adamw", [1.5e-3, 3e-3, 6e-3], "--lr"),
                                                       ("muon", [0.01, 0.02, 0.04], "--muon-lr"))
            for lr in (lrs[1:2] if quick else lrs)]  # --quick: a smoke test, one run each
    # two runs at a time: what is compared is the loss at each step, which no timing touches
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda t: _train(common + windows + ["--optimizer", t[0], t[2], str(t[1])],
                                         out / f"{t[0]}_{t[1]:g}"), todo)
        runs = {}
        for (name, lr, _), rows in zip(todo, done):
            curve = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
            runs[f"{name} lr={lr:g}"] = dict(optimizer=name, lr=lr, curve=curve, final=curve[-1][1])
            print(f"  {name:5} lr={lr:<8g} final val loss {curve[-1][1]:.4f}")
    best_adamw = min((r for r in runs.values() if r["optimizer"] == "adamw"), key=lambda r: r["final"])
    target = best_adamw["final"]

    def steps_to(curve):  # first step where the curve reaches target, linear in between
        prev = (0, float("inf"))
        for s, v in curve:
            if v <= target:
                return prev[0] + (s - prev[0]) * (prev[1] - target) / (prev[1] - v) if prev[1] < float("inf") else s
            prev = (s, v)
        return None
    best_muon = min((r for r in runs.values() if r["optimizer"] == "muon"), key=lambda r: r["final"])
    reach = steps_to(best_muon["curve"])
    return dict(runs=runs, target=target, best_adamw_lr=best_adamw["lr"], best_muon_lr=best_muon["lr"],
                muon_steps_to_target=reach, adamw_steps=steps,
                step_ratio=reach / steps if reach is not None else None)


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    print("1. Newton-Schulz (5 steps), ours vs torch.optim.Muon's, by matrix size")
    ns = _ns_sizes(args.quick, device)
    print(f"{'m x n':>12} {'ours bf16 ms':>13} {'torch ms':>9} {'ratio':>6} {'fp32 ms':>8} {'bf16 TFLOP/s':>13}")
    for r in ns:
        print(f"{r['m']:>5} x {r['n']:<5} {1e3 * r['ours_bf16_s']:13.2f} {1e3 * r['torch_bf16_s']:9.2f} "
              f"{r['ratio']:6.2f} {1e3 * r['ours_fp32_s']:8.2f} {r['bf16_tflops']:13.3f}")
    share = _step_vs_train(args.quick, device)
    print(f"Muon step {1e3 * share['muon_step_s']:.1f} ms vs forward+backward {1e3 * share['fwd_bwd_s']:.1f} ms "
          f"({100 * share['time_fraction']:.1f}% of the time) | FLOPs: {100 * share['flop_fraction']:.2f}% "
          f"of training, Keller's estimate 5m/B = {100 * share['keller_estimate']:.2f}% "
          f"({share['tokens_per_step']} tokens per step)")

    print("2. Distributed Muon step, one thread per rank")
    cfg, _, _ = _model_cfg(args.quick, torch.device("cpu"))
    worlds = [1] + [w for w in args.world_sizes if w > 1]
    dist_t = {w: launch(_distributed_step, w, cfg, 2 if args.quick else 15, timeout_s=600)[0] for w in worlds}
    for w, t in dist_t.items():
        print(f"  {w} rank{'s' if w > 1 else ' '}: {1e3 * t:7.2f} ms  ({t / dist_t[1]:.2f}x one rank)")

    print("3. Muon vs AdamW on the embedded corpus (validation loss)")
    curves = _train_curves(args.quick, out / "muon_runs")
    r = curves["step_ratio"]
    print(f"AdamW's best final val loss {curves['target']:.4f} (lr {curves['best_adamw_lr']:g}); Muon "
          f"(lr {curves['best_muon_lr']:g}) reaches it at step "
          + (f"{curves['muon_steps_to_target']:.0f} of {curves['adamw_steps']}: {r:.2f}x the steps"
             if r is not None else "never within the run"))
    _plot(ns, curves, out / "muon.png")

    print("4. Muon under ZeRO against AdamW at the same stage (default CPU model, gloo)")
    cfg, batch, _ = _model_cfg(args.quick, torch.device("cpu"))
    rounds, steps = (1, 1) if args.quick else (8, 2)
    stages = {n: muon_zero.run(cfg, n, max(1, batch // n), rounds, steps) for n in worlds if n > 1}
    return {"newton_schulz": ns, "step_vs_train": share, "distributed_step_s": dist_t,
            "distributed_ratio": {w: t / dist_t[1] for w, t in dist_t.items()}, "curves": curves,
            "under_zero": stages, "device": device.type}


def _plot(ns, curves, path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("ours_bf16_s", "o-"), ("torch_bf16_s", "s--"), ("ours_fp32_s", "^:")):
        a.loglog([r["m"] * r["n"] for r in ns], [1e3 * r[key] for r in ns], style, label=key[:-2].replace("_", " "))
    a.set(xlabel="matrix entries (m x 4m)", ylabel="ms", title="Newton-Schulz, 5 steps")
    for name, run in curves["runs"].items():
        s, v = zip(*run["curve"])
        b.plot(s, v, "-" if run["optimizer"] == "muon" else "--", label=name)
    b.axhline(curves["target"], color="gray", lw=0.8)
    b.set(xlabel="step", ylabel="validation loss (nats/token)", title="Muon vs AdamW")
    for ax in (a, b):
        ax.legend(fontsize=7), ax.grid(alpha=0.3)
    save_figure(fig, path)


# ------------------------------------------------------------------ Newton-Schulz alone

def singular_value_band(shapes, coefficients="jordan", steps: int = 5, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(smallest, largest) singular value after `steps` steps, over Gaussian random
    matrices of the given shapes: the band a coefficient choice leaves them in."""
    g = torch.Generator().manual_seed(seed)
    sv = [torch.linalg.svdvals(newton_schulz(torch.randn(*s, generator=g), steps, dtype,
                                             coefficients=coefficients).float()) for s in shapes]
    sv = torch.cat(sv)
    return sv.min().item(), sv.max().item()


def time_batched(shapes, repeats: int = 15, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict:
    """Median seconds to orthogonalise one matrix of each shape, one by one and batched by
    shape (the work of one Muon step): the two taking turns `repeats` times, so that a
    noisy moment hurts both alike."""
    g = torch.Generator().manual_seed(seed)
    Ms = [torch.randn(*s, generator=g) for s in shapes]
    runs = {"per_matrix": lambda: [newton_schulz(M, 5, dtype) for M in Ms],
            "batched": lambda: newton_schulz_many(Ms, 5, dtype)}
    med = {f"{k}_s": m.median for k, m in interleaved(runs, repeats).items()}
    return {**med, "speedup": med["per_matrix_s"] / med["batched_s"]}


def newton_schulz_report() -> None:
    d, layers = PRESETS["tiny"]["n_embd"], PRESETS["tiny"]["n_layer"]
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers  # train_gpt's CPU model
    for shape in dict.fromkeys(shapes):  # Gaussian matrices; a square one has near-zero values
        for name in ("jordan", "polar_express"):
            bands = [(dt, *singular_value_band([shape] * 4, name, dtype=getattr(torch, dt)))
                     for dt in ("float32", "bfloat16")]
            print(f"{str(shape):>10} {name:>13}: singular values after 5 steps in "
                  + ", ".join(f"[{lo:.3f}, {hi:.3f}] ({dt})" for dt, lo, hi in bands))
    t = time_batched(shapes)
    print(f"{len(shapes)} matrices, bf16: one by one {1e3 * t['per_matrix_s']:.2f} ms, batched "
          f"by shape {1e3 * t['batched_s']:.2f} ms ({t['speedup']:.2f}x)")


if __name__ == "__main__":
    newton_schulz_report()
