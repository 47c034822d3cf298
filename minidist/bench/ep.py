"""`python -m minidist.bench ep`: expert parallelism measured. Chapter 13
(chapters/13_experts.md, which reads the tables). Exercised by `python -m minidist.bench ep
--quick` (tests/test_bench.py).

1. Bytes. One MoE layer (minidist/experts/moe.py), fp32, dropless and at capacity 1, split
   over ep 2 and 4 (a process each): what each comm.all_to_all call sends (comm.count_bytes),
   forward and backward, against ep_model.a2a_bytes given the choices one process's routing
   keeps per rank and expert; the output against one process's on the whole batch (TOL).
2. Step time of that layer, forward + backward, dropless, ep n beside n processes that each
   hold every expert, the same tokens per rank (ep ranks are data-parallel ranks elsewhere),
   taking turns; the median, the slowest rank; beside the cost model's PREDICTION for a GPU
   node (ep_model: alpha-beta all-to-alls, NVLink in a node, InfiniBand across).
3. Tokens per expert over a short training of MoEGPT on the embedded corpus with and without
   the balance loss (the same start and batches): max/mean load per layer, the val loss.
4. Drops against capacity factor (0.5, 1, 1.25, 2, dropless) on each run's final router, one
   validation batch, beside the fewest any router could drop (a perfectly even one).
It writes ep.png into --out, and with MINIDIST_FIGURES=1 (as scripts/run_notebooks.py sets it)
also chapters/figures/13_tokens_per_expert.png.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import comm
from minidist.bench import ep_model
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import interleaved
from minidist.cost_model import Hardware
from minidist.data import TokenLoader, default_data_dir, prepare_shakespeare
from minidist.experts import MoE, MoEConfig, MoEGPT, capacity
from minidist.experts.parallel import ExpertParallelMoE
from minidist.launch import launch
from minidist.model import GPTConfig

LAYER = dict(C=128, hidden=512, E=8, k=2, B=8, T=128, eps=(1, 2, 4), repeats=9)
TRAIN = dict(model=dict(n_layer=2, n_head=2, n_embd=64, block_size=64), E=8, k=2, aux=0.01, lr=3e-3,
             steps=200, batch=16, seq=64, val_batch=32, last=10)
QUICK_LAYER = dict(C=16, hidden=32, E=4, k=2, B=2, T=8, eps=(2, 4), repeats=1)
QUICK_TRAIN = dict(model=dict(n_layer=2, n_head=2, n_embd=16, block_size=16), E=4, k=2, aux=0.01, lr=3e-3,
                   steps=6, batch=4, seq=16, val_batch=4, last=3)
FACTORS = (0.0, 1.0)  # the bytes' cases: dropless, and capacity 1 (fewer rows sent)
CAPACITY = (0.5, 1.0, 1.25, 2.0, 0.0)  # 0: dropless
TOKENIZER, VOCAB = "gpt2-2048", 2048  # train_gpt's CPU default
TOL = 1e-5  # fp32: the same rows, the experts' matmuls on other groupings of them
FIGURE = Path(__file__).resolve().parents[2] / "chapters" / "figures" / "13_tokens_per_expert.png"


@contextlib.contextmanager
def _calls():
    """(comm.all_to_all's calls while inside, in order: (a float tensor?, bytes it sent); every
    byte comm sent, by collective): one count_bytes, read before and after each call."""
    calls, real = [], comm.all_to_all
    with comm.count_bytes() as sent:
        def counted(output, input, *a, **kw):
            before = sent["all_to_all"]
            done = real(output, input, *a, **kw)
            calls.append((input.is_floating_point(), sent["all_to_all"] - before))
            return done
        comm.all_to_all = counted  # parallel.py calls comm.all_to_all by its module: this one
        try:
            yield calls, sent
        finally:
            comm.all_to_all = real


def _layer_rank(s: dict) -> dict:
    """On every rank of ep n: the bytes and the error per capacity case, and the step time."""
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)  # every rank's tokens, the same on every rank
    x = torch.randn(n * s["B"], s["T"], s["C"], generator=g)
    w = torch.randn(n * s["B"], s["T"], s["C"], generator=g)  # the gradient from above
    mine = slice(r * s["B"], (r + 1) * s["B"])
    out = {"cases": []}
    for factor in FACTORS:
        torch.manual_seed(0)
        moe = MoE(s["C"], s["E"], s["k"], hidden=s["hidden"], capacity_factor=factor)
        kept = ep_model.kept_counts(moe, x, n)
        if n == 1:  # nothing to send: the oracle itself
            out["cases"].append(dict(capacity=factor, kept=kept, sent={}, total=0, err=0.0))
            continue
        layer = ExpertParallelMoE(copy.deepcopy(moe), dist.group.WORLD, dist.group.WORLD)
        want = moe(x)[mine].detach()
        with _calls() as (calls, total):
            y = layer(x[mine].clone().requires_grad_())  # as in a model: its input wants a gradient
            forward = len(calls)
            y.backward(w[mine])
        rows = [b for f, b in calls[:forward] if f]  # dispatch, then combine
        sent = dict(counts=sum(b for f, b in calls[:forward] if not f), dispatch=rows[0], combine=rows[1],
                    backward=sum(b for _, b in calls[forward:]))
        out["cases"].append(dict(capacity=factor, kept=kept, sent=sent, total=sum(total.values()),
                                 err=(y.detach() - want).abs().max().item()))
    torch.set_num_threads(1)  # one a rank at every n, so a rank's time means the same at each (as muon's)
    torch.manual_seed(0)
    every = MoE(s["C"], s["E"], s["k"], hidden=s["hidden"])  # a replica of the whole layer, nothing sent
    layers = {"every": every, "ep": ExpertParallelMoE(copy.deepcopy(every), dist.group.WORLD, dist.group.WORLD)}
    xs, ws = x[mine].clone().requires_grad_(), w[mine].contiguous()

    def step(layer):
        layer.zero_grad(set_to_none=True)
        layer(xs).backward(ws)
    steps = {k: functools.partial(step, v) for k, v in layers.items() if n > 1 or k == "every"}
    times = interleaved(steps, s["repeats"], before=lambda _: dist.barrier())
    out.update(step_s={k: m.median for k, m in times.items()}, threads=torch.get_num_threads())
    return out


def _train_rank(s: dict, data: str) -> dict:
    """Rank 0 trains with the balance loss, rank 1 without: the same model, start and batches.
    The choices per expert at every step; then, on one validation batch, the cross-entropy
    and the drops at each capacity factor."""
    weight = s["aux"] if dist.get_rank() == 0 else 0.0
    train = TokenLoader(f"{data}/train_*.bin", s["seq"], s["batch"], vocab_size=VOCAB)
    val = TokenLoader(f"{data}/val_*.bin", s["seq"], s["val_batch"], vocab_size=VOCAB)
    torch.manual_seed(0)
    model = MoEGPT(GPTConfig(**s["model"], vocab_size=VOCAB), MoEConfig(s["E"], s["k"], aux_loss_weight=weight))
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=0.0)
    tokens = []
    for step in range(s["steps"]):
        x, y = train.batch(step)
        loss = model(x, y)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens.append([m.stats["tokens"] for m in model.moe_layers()])
    (x, y), drops = val.batch(0), []
    with torch.no_grad():
        model.eval()
        val_loss = model(x, y)[1].item()  # (in eval the cross-entropy alone: comparable across runs)
        for factor in CAPACITY:
            for m in model.moe_layers():
                m.capacity_factor = factor
            model(x)
            drops.append([m.stats["dropped"] for m in model.moe_layers()])
    return dict(aux=weight, tokens=tokens, val_loss=val_loss, drops=drops, val_tokens=x.numel())


def _bytes_and_time(s: dict, hw: Hardware) -> tuple[list, list]:
    rows, times = [], []
    for n in s["eps"]:
        ranks = launch(_layer_rank, n, s, timeout_s=600)
        for i, case in enumerate(ranks[0]["cases"] if n > 1 else []):  # (ep 1 sends nothing)
            formula = ep_model.a2a_bytes(case["kept"], s["C"])
            for r, got in enumerate(rank["cases"][i] for rank in ranks):
                rows.append(dict(ep=n, capacity=case["capacity"], rank=r, **got["sent"], total=got["total"],
                                 formula=formula[r], kept=case["kept"], err=got["err"],
                                 equal=got["sent"] == formula[r] and got["total"] == sum(formula[r].values()),
                                 uniform=ep_model.uniform_bytes(s["B"] * s["T"], s["k"], s["C"], n)))
        every = max(rank["step_s"]["every"] for rank in ranks)
        ep = max(rank["step_s"].get("ep", every) for rank in ranks)
        times.append(dict(ep=n, every_s=every, ep_s=ep, ratio=ep / every, threads=ranks[0]["threads"],
                          predicted=ep_model.beside(n, hw)))
    return rows, times


def run(args) -> dict:
    s, t = (QUICK_LAYER, QUICK_TRAIN) if args.quick else (LAYER, TRAIN)
    hw = Hardware()
    result = dict(layer=s, train=t, tolerance=TOL, cores=os.cpu_count(), hardware=hw.name)
    print(f"one MoE layer: width {s['C']}, {s['E']} experts of {s['hidden']}, top-{s['k']}, "
          f"{s['B'] * s['T']} tokens per rank, fp32; ep n = n processes on {os.cpu_count()} CPU cores")
    rows, times = result["bytes"], result["step"] = _bytes_and_time(s, hw)
    print("\nbytes each rank sends per step (comm.count_bytes, by call) against ep_model.a2a_bytes "
          "(given one process's kept choices per rank and expert)")
    print(f"  {'ep':>2} {'capacity':>8} {'rank':>4} | {'counts':>6} {'dispatch':>9} {'combine':>9} "
          f"{'backward':>9} | {'= formula':>9} | {'even routing':>12} | {'max err':>8}")
    for r in rows:
        cap = "dropless" if not r["capacity"] else f"{r['capacity']:g}"
        print(f"  {r['ep']:2d} {cap:>8} {r['rank']:4d} | {r['counts']:6d} {r['dispatch']:9d} {r['combine']:9d} "
              f"{r['backward']:9d} | {'yes' if r['equal'] else 'NO':>9} | {r['uniform']:12.0f} | "
              f"{r['err']:8.1e}" + ("" if r["err"] <= TOL else " !"))
    result["bytes_equal_formula"] = all(r["equal"] for r in rows)
    result["outputs_within_tolerance"] = all(r["err"] <= TOL for r in rows)
    print(f"  every rank, ep and case: bytes == a2a_bytes: {result['bytes_equal_formula']}; outputs within "
          f"{TOL:g} of one process: {result['outputs_within_tolerance']} (even routing: the dispatch of a "
          "router that spreads every rank's choices evenly; the capacity statistics' all-gather of E counts "
          "is torch's, apart)")
    print(f"\nstep time, forward + backward, {s['B'] * s['T']} tokens per rank, median of {s['repeats']}, slowest "
          "rank, one thread each, taking turns: ep n against n processes that each hold every expert and send nothing (the same "
          "tokens and cores: the difference is what ep costs); GPU pred.: PREDICTED by ep_model at "
          f"{ep_model.BESIDE} on ep GPUs of one node, against one GPU holding every expert (1 is free)")
    print(f"  {'ep':>2} {'every expert ms':>15} {'ep ms':>7} {'ep / every':>10} {'GPU pred.':>9}")
    for r in times:
        print(f"  {r['ep']:2d} {1e3 * r['every_s']:15.1f} {1e3 * r['ep_s']:7.1f} {r['ratio']:10.2f} {r['predicted']:9.3f}")
    result["at_scale"] = ep_model.print_at_scale(hw)
    data = default_data_dir(TOKENIZER)
    prepare_shakespeare(data, TOKENIZER, log=None)  # here, once: the two ranks read it
    runs = launch(_train_rank, 2, t, data, timeout_s=900)
    result["training"] = _print_training(t, runs)
    _plot(result, runs, Path(args.out) / "ep.png")
    if os.environ.get("MINIDIST_FIGURES") == "1":
        _chapter_figure(runs, t)
        print(f"wrote {FIGURE}")
    return result


def _print_training(t: dict, runs: list[dict]) -> dict:
    m = t["model"]
    print(f"\ntokens per expert: MoEGPT ({m['n_layer']} layers, {m['n_embd']} wide, {t['E']} experts, "
          f"top-{t['k']}, dropless), {t['steps']} steps of {t['batch']} x {t['seq']} tokens of the embedded "
          f"corpus, AdamW {t['lr']:g}, the same start and batches; max/mean choices per expert "
          f"(1 even, {t['E']} collapsed), at step 0 and averaged over the last {t['last']} steps")
    print(f"  {'balance loss':>12} | " + " | ".join(f"L{i} start   end" for i in range(len(runs[0]["tokens"][0])))
          + f" | val loss ({runs[0]['val_tokens']} tokens)")
    out = {"runs": []}
    for run in runs:
        per_layer = list(zip(*run["tokens"]))  # layer -> steps
        start = [ep_model.balance(layer[0]) for layer in per_layer]
        end = [sum(map(ep_model.balance, layer[-t["last"]:])) / t["last"] for layer in per_layer]
        out["runs"].append(dict(aux=run["aux"], start=start, end=end, val_loss=run["val_loss"], tokens=run["tokens"]))
        print(f"  {run['aux']:12g} | " + " | ".join(f"{a:8.2f} {b:5.2f}" for a, b in zip(start, end))
              + f" | {run['val_loss']:.4f}")
    N, choices = runs[0]["val_tokens"], runs[0]["val_tokens"] * t["k"]
    print(f"\ndrops against capacity factor: one validation batch of {N} tokens ({choices} choices), each "
          "run's final router; choices dropped per layer (% of the choices); fewest: what a perfectly "
          "even router drops (choices beyond E x slots)")
    width = 11 * len(runs[0]["drops"][0]) - 1  # the layers' cells
    print(f"  {'capacity':>8} {'slots':>5} | " + " | ".join(f"aux {r['aux']:g}".rjust(width) for r in runs)
          + f" | {'fewest':>6}")
    out["drops"] = []
    for i, factor in enumerate(CAPACITY):
        slots = capacity(N, t["E"], t["k"], factor)
        fewest = 0 if slots is None else max(0, choices - t["E"] * slots)
        cells = [" ".join(f"{d:4d} {100 * d / choices:4.1f}%" for d in r["drops"][i]) for r in runs]
        out["drops"].append(dict(capacity=factor, slots=slots, fewest=fewest,
                                 **{f"aux {r['aux']:g}": r["drops"][i] for r in runs}))
        print(f"  {'dropless' if not factor else f'{factor:g}':>8} {slots or '-':>5} | " + " | ".join(cells)
              + f" | {fewest:6d}")
    return out


def _tokens_panels(axes, runs: list[dict], t: dict) -> None:
    """Per run, layer 0's share of the choices per expert over the steps; then max/mean."""
    for ax, run in zip(axes, runs):
        shares = torch.nn.functional.normalize(torch.tensor([st[0] for st in run["tokens"]], dtype=torch.float), p=1)
        ax.stackplot(range(len(shares)), shares.T.numpy(), colors=[f"C{e}" for e in range(t["E"])])
        ax.set(xlabel="step", ylabel="share of layer 0's choices", ylim=(0, 1), xlim=(0, len(shares) - 1),
               title=f"balance loss weight {run['aux']:g}" + (" (none)" if not run["aux"] else ""))
    w = min(t["last"], t["steps"])
    for j, run in enumerate(runs):
        for layer in range(len(run["tokens"][0])):
            b = torch.tensor([ep_model.balance(step[layer]) for step in run["tokens"]])
            axes[2].plot(range(w - 1, len(b)), b.unfold(0, w, 1).mean(1), color=f"C{j}", ls="-:"[layer % 2],
                         label=f"aux {run['aux']:g}, layer {layer}")
    axes[2].axhline(1, color="black", lw=0.8)
    axes[2].set(xlabel="step", ylabel=f"max / mean choices per expert (mean of {w})", title="load imbalance")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)


def _plot(result: dict, runs: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    _tokens_panels(axes[0], runs, result["train"])
    drops = result["training"]["drops"]
    choices = runs[0]["val_tokens"] * result["train"]["k"]
    xs = range(len(drops))
    for j, run in enumerate(runs):
        axes[1, 0].plot(xs, [100 * sum(d[f"aux {run['aux']:g}"]) / (choices * len(run["drops"][0]))
                             for d in drops], marker="o", color=f"C{j}", label=f"aux {run['aux']:g}")
    axes[1, 0].plot(xs, [100 * d["fewest"] / choices for d in drops], ls=":", color="black", label="even router")
    axes[1, 0].set_xticks(xs, [f"{d['capacity']:g}" if d["capacity"] else "dropless" for d in drops])
    axes[1, 0].set(xlabel="capacity factor", ylabel="% of choices dropped (all layers)", title="drops")
    ok = [r for r in result["bytes"] if r["capacity"] == 0.0]
    labels = [f"ep {r['ep']} r{r['rank']}" for r in ok]
    axes[1, 1].bar(labels, [sum(r[k] for k in r["formula"]) / 1e3 for r in ok], color="C0", label="count_bytes")
    axes[1, 1].scatter(labels, [sum(r["formula"].values()) / 1e3 for r in ok], marker="_", s=300,
                       color="black", zorder=3, label="a2a_bytes")
    axes[1, 1].set(ylabel="KB sent per step", title="all-to-all bytes per rank (dropless)")
    eps = [str(r["ep"]) for r in result["step"]]
    axes[1, 2].bar(eps, [r["ratio"] for r in result["step"]], color="C0", label="CPU, measured")
    axes[1, 2].scatter(eps, [r["predicted"] for r in result["step"]], marker="_", s=300, color="black",
                       zorder=3, label=f"predicted, GPU node ({ep_model.BESIDE})")
    axes[1, 2].set(xlabel="ep", ylabel="step / every expert on each rank", title="what ep costs: fwd + bwd")
    for ax in axes[1]:
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(f"Expert parallelism: measured on {result['cores']} CPU cores; GPU figures predicted "
                 "by the cost model", fontsize=10)
    save_figure(fig, path)


def _chapter_figure(runs: list[dict], t: dict) -> None:
    """13_tokens_per_expert.png: the tokens panels alone, palette PNG (a chapter figure's size)."""
    from PIL import Image  # matplotlib's own dependency
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    _tokens_panels(axes, runs, t)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    Image.open(buf).convert("RGB").quantize(256).save(FIGURE, format="PNG", optimize=True)
