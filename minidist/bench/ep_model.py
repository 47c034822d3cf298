"""The closed forms behind `python -m minidist.bench ep`: the bytes of expert parallelism's
all-to-alls given the routing, and the cost model's prediction of an MoE layer's step on
GPUs. Chapter 13 (chapters/13_experts.md). Exercised by `python -m minidist.bench ep --quick`
(tests/test_bench.py, which also holds a2a_bytes equal to comm.count_bytes at ep 2 and 4).

Bytes, per MoE layer and step, on rank r of an ep group of n (minidist/experts/parallel.py):
with c[s][e] the choices rank s keeps for expert e, and rank j holding experts j*E/n ..
(j+1)*E/n - 1, let out_r = the rows r sends to the other ranks' experts and in_r = the rows
the other ranks send to r's experts. Then, C the width and b the element's bytes:
    counts    (n - 1) * E/n * 8       the int64 counts, one block per other rank
    dispatch  out_r * C * b           the tokens to their experts
    combine   in_r * C * b            the results back to their tokens' ranks
    backward  (out_r + in_r) * C * b  both all-to-alls again, the splits swapped
A rank's own block is copied, never sent; the counts are not sent again in backward; the
dispatch's backward runs because the layer's input wants its gradient, as inside a model.

Prediction: one MoE layer of minidist's form (two-matrix GELU experts) at a production
model's widths, bf16, dropless and evenly routed, forward + backward on each of n GPUs
holding E/n experts, every GPU with its own `tokens` (the ep ranks are data-parallel ranks
for the rest of the model). Compute is the same on every n (a token costs its k experts,
wherever they are); the price of ep is four all-to-alls of the rows (two each way) and one
of the counts, none hidden, as minidist's code waits for each. Once n spans nodes,
cost_model.link charges every block at InfiniBand's pace; a rank's gpus_per_node - 1 blocks
inside its node go faster, so that is pessimistic by up to 7/15 of the transfer at n = 16 and
7/63 at 64. NCCL's and DeepEP's kernels also send all blocks at once and overlap them with
compute, and DeepSeek-V3 limits each token to 4 nodes: the IB rows are the upper end.
"""

from __future__ import annotations

import torch

from minidist.cost_model import GB, Hardware, collective_time
from minidist.experts import capacity, keep_first, route

COUNT_BYTES = 8  # torch.bincount's int64
# one layer at a production model's widths (d, expert hidden h, E experts, top-k), the tokens
# each GPU holds, the ep sizes to predict; the second needs more GPUs than a node has
LAYERS = {
    "Mixtral-8x7B widths": dict(d=4096, h=14336, E=8, k=2, tokens=8192, eps=(1, 2, 4, 8)),
    "DeepSeek-V3 widths": dict(d=7168, h=2048, E=256, k=8, tokens=4096, eps=(1, 8, 16, 32, 64)),
}
BESIDE = "Mixtral-8x7B widths"  # the layer whose prediction stands beside the CPU's step times


@torch.no_grad()
def kept_counts(moe, x: torch.Tensor, n: int) -> list[list[int]]:
    """c[s][e]: the choices of expert e kept among rank s's tokens when the batch `x` (every
    rank's tokens, in rank order) is split over n ranks, from one process's routing of the
    whole batch (minidist.experts.route and keep_first: capacity counts the whole batch)."""
    h = x.reshape(-1, x.shape[-1])
    _, _, experts = route(moe.router(h), moe.top_k)
    cap = capacity(h.shape[0], moe.n_experts, moe.top_k, moe.capacity_factor)
    keep = keep_first(experts, moe.n_experts, cap)
    rows = h.shape[0] // n
    return [torch.bincount(experts[s * rows:(s + 1) * rows][keep[s * rows:(s + 1) * rows]],
                           minlength=moe.n_experts).tolist() for s in range(n)]


def balance(counts: list[int]) -> float:
    """max/mean of the choices per expert: 1 even, E all on one expert."""
    return max(counts) / (sum(counts) / len(counts))


def a2a_bytes(kept: list[list[int]], width: int, elem: int = 4) -> list[dict]:
    """Per rank: the bytes each of its all-to-alls sends in one step of one layer (the formula
    of the docstring), given kept[s][e]."""
    n, E = len(kept), len(kept[0])
    per = E // n
    to = [[sum(kept[s][j * per:(j + 1) * per]) for j in range(n)] for s in range(n)]  # rows s -> j
    rows = []
    for r in range(n):
        out_r = sum(to[r][j] for j in range(n) if j != r)
        in_r = sum(to[j][r] for j in range(n) if j != r)
        rows.append(dict(counts=(n - 1) * per * COUNT_BYTES, dispatch=out_r * width * elem,
                         combine=in_r * width * elem, backward=(out_r + in_r) * width * elem))
    return rows


def uniform_bytes(tokens: int, k: int, width: int, n: int, elem: int = 4) -> float:
    """One row all-to-all's bytes per rank when routing is even and nothing is dropped:
    (n - 1)/n of the tokens * k rows (the estimate the prediction uses)."""
    return (n - 1) / n * tokens * k * width * elem


def predict(d: int, h: int, E: int, k: int, tokens: int, n: int, hw: Hardware, elem: int = 2) -> dict:
    """Predicted seconds of one MoE layer's forward + backward on each of n GPUs, and what
    each holds: the parts, the ratio to one GPU (the same tokens, every expert, no
    all-to-all), each GPU's expert weights in GB."""
    flops = 3 * (2 * tokens * k * 2 * d * h + 2 * tokens * d * E)  # backward twice the forward
    compute = flops / (hw.peak_flops * hw.mfu)
    rows = tokens * k * d * elem  # one all-to-all's buffer: every choice's row
    comm = 4 * collective_time("all_to_all", rows, n, hw) + collective_time("all_to_all", E * COUNT_BYTES, n, hw)
    return dict(compute_s=compute, comm_s=comm, step_s=compute + comm, vs_one_gpu=(compute + comm) / compute,
                sent_GB=(4 * uniform_bytes(tokens, k, d, n, elem) + (n - 1) / n * E * COUNT_BYTES) / GB,
                experts_GB=E // n * (2 * d * h + d + h) * elem / GB)


def beside(n: int, hw: Hardware) -> float:
    """The predicted step at ep n over one GPU's, for BESIDE's layer (1 is free)."""
    s = LAYERS[BESIDE]
    return predict(s["d"], s["h"], s["E"], s["k"], s["tokens"], n, hw)["vs_one_gpu"]


def at_scale(hw: Hardware | None = None) -> list[dict]:
    """Every layer of LAYERS at its ep sizes: predicted ms, GB sent and held per GPU."""
    hw = hw or Hardware()
    out = []
    for name, s in LAYERS.items():
        for n in s["eps"]:
            p = predict(s["d"], s["h"], s["E"], s["k"], s["tokens"], n, hw)
            out.append(dict(layer=name, ep=n, compute_ms=1e3 * p["compute_s"], comm_ms=1e3 * p["comm_s"],
                            step_ms=1e3 * p["step_s"], vs_one_gpu=p["vs_one_gpu"], sent_GB=p["sent_GB"],
                            experts_GB=p["experts_GB"], over_nvlink=n <= hw.gpus_per_node))
    return out


def print_at_scale(hw: Hardware) -> list[dict]:
    """Print at_scale's table, labelled a prediction; return its rows."""
    rows = at_scale(hw)
    print(f"\nPREDICTED, not measured: one MoE layer (minidist's GELU experts), bf16, dropless, even routing, "
          f"forward + backward per GPU, each GPU its own tokens; {hw.name}")
    print(f"  {'layer':20} {'ep':>3} {'link':>6} | {'compute':>8} {'a2a':>7} {'step ms':>8} {'/ 1 GPU':>7} | "
          f"{'sent GB':>7} {'experts GB':>10}")
    for r in rows:
        print(f"  {r['layer']:20} {r['ep']:3d} {'NVLink' if r['over_nvlink'] else 'IB':>6} | "
              f"{r['compute_ms']:8.2f} {r['comm_ms']:7.2f} {r['step_ms']:8.2f} {r['vs_one_gpu']:7.2f} | "
              f"{r['sent_GB']:7.3f} {r['experts_GB']:10.2f}")
    for name, s in LAYERS.items():
        print(f"  ({name}: d {s['d']}, expert hidden {s['h']}, {s['E']} experts, top-{s['k']}, "
              f"{s['tokens']} tokens per GPU)")
    return rows
