"""`python -m minidist.bench tp`: tensor parallelism on this machine beside the cost model's
prediction for a GPU node. Chapter 10 (chapters/10_tensor_parallel.md). Exercised by
`python -m minidist.bench tp --quick` (tests/test_bench.py).

Per world size N and tp dividing it (dp = N / tp): bytes handed to collectives, parameter
bytes and one block's saved activations, each against tensor_parallel.cost's formula; the
step time relative to tp 1, beside tp_step_time's prediction for a GPU node; and our
parallel MLP against torch's DTensor plans. On a 2-core CPU tensor parallelism is expected
to lose to data parallelism (each loopback all-reduce costs more than its halved matmuls save).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.bench import collective_bytes, cpu_default
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import interleaved
from minidist.cost_model import SENT_FRACTION
from minidist.launch import launch
from minidist.memory import count_saved_bytes
from minidist.compose.mesh import make_mesh
from minidist.model import GPT, GPTConfig
from minidist.tensor_parallel.cost import comm_bytes, param_bytes, tp_block_activation_bytes, tp_step_time
from minidist.tensor_parallel.gpt import ParallelMLP, parallelize
from minidist.compose.build import gradient_sync
from minidist.train import forward_backward

def _layout(cfg, tp, sp):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    mesh = make_mesh(tp=tp)
    if tp > 1:
        model = parallelize(model, mesh.tp_group, sp)
    sync = gradient_sync(model, None, mesh=mesh)  # DDP over dp (bucketed, 25 MiB), with tp's norm
    return model, mesh, sync, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _measure(cfg, global_batch, rounds, steps, layouts):
    rank = dist.get_rank()
    built = {name: _layout(cfg, tp, sp) for name, (tp, sp) in layouts.items()}
    out = {}
    for name, (model, mesh, sync, opt) in built.items():
        g = torch.Generator().manual_seed(mesh.dp_rank)  # a replica's tp ranks share its batch
        x = torch.randint(0, cfg["vocab_size"], (global_batch // mesh.dp, cfg["block_size"]), generator=g)
        y = torch.roll(x, -1, 1)
        with collective_bytes() as c, sync.no_sync():  # tensor parallelism's own bytes, no averaging
            model(x, y)[1].backward()
        model.zero_grad()
        saved = count_saved_bytes(model, x, y)["blocks"][0]
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out[name] = dict(counted=dict(c), params=params, saved=saved, batch=(x, y))

    def step(name):
        model, mesh, sync, opt = built[name]
        forward_backward(model, [out[name]["batch"]], mesh.dp, sync, group=mesh.dp_group)
        sync.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = interleaved({n: (lambda n=n: step(n)) for n in built}, rounds, steps, before=lambda n: dist.barrier())
    for name in built:
        out[name]["step_s"] = times[name].median
        del out[name]["batch"]
    out["mlp"] = _mlp_vs_torch(cfg, global_batch, rounds, steps)
    return out if rank == 0 else None


def _mlp_vs_torch(cfg, global_batch, rounds, steps) -> dict:
    """Our ParallelMLP against torch's DTensor plans on the same MLP, all ranks one tp group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    full = GPT(GPTConfig(**cfg)).blocks[0].mlp
    n = dist.get_world_size()
    ours = ParallelMLP(full, dist.group.WORLD)
    theirs = parallelize_module(nn.Sequential(full.c_fc, nn.GELU(approximate="tanh"), full.c_proj),
                                init_device_mesh("cpu", (n,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(global_batch, cfg["block_size"], cfg["n_embd"], generator=torch.Generator().manual_seed(1))

    def fb(m):
        xi = x.clone().requires_grad_()
        m(xi).square().mean().backward()
    times = interleaved({"ours": lambda: fb(ours), "torch": lambda: fb(theirs)}, rounds, max(steps, 2),
                        before=lambda k: dist.barrier())
    return {k: m.median for k, m in times.items()}


def run(args) -> dict:
    cfg, global_batch, rounds, steps = cpu_default(args.quick)
    gcfg = GPTConfig(**cfg)
    B, T = global_batch, cfg["block_size"]
    result = {"config": cfg, "runs": {}}
    print(f"default GPT ({gcfg.n_layer} layers, d={gcfg.n_embd}, vocab {gcfg.vocab_size}), "
          f"{B} x {T} tokens per step, fp32, AdamW")
    for n in args.world_sizes:
        tps = [t for t in (1, 2, 4) if n % t == 0 and gcfg.n_head % t == 0 and t <= n]
        layouts = {f"tp {t}" + (" sp" if sp else ""): (t, sp) for t in tps for sp in ((False, True) if t > 1 else (False,))}
        r = launch(_measure, n, cfg, B, rounds, steps, layouts, timeout_s=900)[0]
        result["runs"][n] = r
        base = r["tp 1"]["step_s"]
        print(f"\nN = {n}: {'layout':9} {'dp':>3} {'sent KB':>8} {'/formula':>8} {'params KB':>9} {'/formula':>8} "
              f"{'block act KB':>12} {'/formula':>8} {'step vs tp 1':>12} {'predicted, GPU':>14}")
        for name, (t, sp) in layouts.items():
            m, dp = r[name], n // t
            b = B // dp
            f = comm_bytes(gcfg, b, T, t, sp)
            sent = sum(SENT_FRACTION[k](t) * v for k, v in m["counted"].items()) if t > 1 else 0.0
            pf = param_bytes(gcfg, t)
            af = tp_block_activation_bytes(b, T, gcfg.n_embd, gcfg.n_head, t, sp)
            pred = tp_step_time(gcfg, b, T, t)["step_s"] / tp_step_time(gcfg, B // n, T, 1)["step_s"]
            m.update(sent=sent, sent_formula=f["sent"], params_formula=pf, saved_formula=af, predicted=pred)
            ratio = lambda a, c: f"{a / c:8.3f}" if c else f"{'-':>8}"
            print(f"{'':7}{name:9} {dp:3d} {sent / 1e3:8.1f} {ratio(sent, f['sent'])} {m['params'] / 1e3:9.1f} "
                  f"{ratio(m['params'], pf)} {m['saved'] / 1e3:12.1f} {ratio(m['saved'], af)} "
                  f"{m['step_s'] / base:12.2f} {pred:14.2f}")
        mlp = r["mlp"]
        print(f"{'':7}our tensor-parallel MLP vs torch's (DTensor), forward + backward at tp {n}: "
              f"{mlp['ours'] / mlp['torch']:.2f} x")
    print("\n(step vs tp 1: measured here; predicted: the cost model for a GPU node, the same model and "
          "batch, tensor_parallel_cost.tp_step_time)")
    _plot(result, Path(args.out) / "tp.png")
    return result


def _plot(result, path) -> None:
    plt = pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.8), squeeze=False)
    for ax, (n, r) in zip(axes[0], runs.items()):
        names = [k for k in r if k.startswith("tp ")]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r[k]["step_s"] / r["tp 1"]["step_s"] for k in names], 0.4,
               label="measured here")
        ax.bar([x + 0.2 for x in xs], [r[k]["predicted"] for k in names], 0.4, hatch="//",
               label="predicted, GPU node")
        ax.set_xticks(list(xs), names)
        ax.set(ylabel="step time / tp 1's", title=f"tensor parallelism, {n} ranks")
        ax.legend(), ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)
