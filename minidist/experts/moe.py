"""A mixture of experts in one process: a router sends each token to k of E expert MLPs,
and the token's output is their gate-weighted sum. Chapter 13 (chapters/13_experts.md);
`pytest tests/test_experts.py` holds it equal to a loop over tokens and to expert
parallelism (minidist/experts/parallel.py).

Read top to bottom: `route` (softmax gates, top-k, renormalised), `capacity` and
`keep_first` (which choices fit an expert's slots), `balance_sum` (the auxiliary loss that
keeps the router from collapsing onto one expert), then `MoE`, whose forward is four
steps: route, dispatch (sort the kept choices by expert, so each expert's tokens are one
contiguous block), run the experts, combine (scatter each result back to its token,
times its gate).

The statistics behind capacity and balance are taken over the whole micro-batch of every
rank that holds other tokens (`group`: one small all-gather of E counts), so the same
tokens are dropped, and the same loss computed, however the batch is split; real systems
often count per rank instead, which is cheaper and depends on the split.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int):
    """(probs (N, E), gates (N, k), experts (N, k)): the router's softmax over the E experts
    (fp32, whatever the compute dtype), each token's k most probable experts, and their
    probabilities renormalised to sum to 1 (Mixtral's and Qwen-MoE's form). At k = 1 the
    gate is the probability itself (Switch Transformer's): one renormalised gate is 1
    whatever the router says, and the loss would teach the router nothing."""
    probs = logits.float().softmax(dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    return probs, gates / gates.sum(dim=-1, keepdim=True) if top_k > 1 else gates, experts


def capacity(n_tokens: int, n_experts: int, top_k: int, factor: float) -> int | None:
    """An expert's slots in a micro-batch of `n_tokens`: `factor` times its even share of the
    n_tokens * top_k choices, rounded up (GShard's capacity); factor 0 means no limit (dropless)."""
    return math.ceil(factor * n_tokens * top_k / n_experts) if factor > 0 else None


def keep_first(experts: torch.Tensor, n_experts: int, cap: int | None,
               offset: torch.Tensor | None = None) -> torch.Tensor:
    """Which choices (N, k) fit: each expert takes the first `cap` choices made of it, in
    token order (then slot order); `offset` (E,): choices of it already made by earlier
    tokens on other ranks. Dropped choices contribute nothing: the residual carries the token."""
    flat = experts.reshape(-1)
    if cap is None:
        return torch.ones_like(flat, dtype=torch.bool).view_as(experts)
    place = (F.one_hot(flat, n_experts).cumsum(0) - 1).gather(1, flat[:, None])[:, 0]  # its turn
    if offset is not None:
        place = place + offset[flat]
    return (place < cap).view_as(experts)


def balance_sum(probs: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss (Switch Transformer, Fedus et al. 2021; GShard) times the
    micro-batch's token count: E * sum_i f_i * P_i, with f_i the fraction of the choices
    that went to expert i (counted, so no gradient) and P_i the mean router probability of
    i. Here P_i's sum over this rank's tokens stands for P_i * N, so the ranks' terms add up
    to the whole batch's loss times N. It is 1 when routing is uniform, E when collapsed."""
    return probs.shape[-1] * (f * probs.sum(dim=0)).sum()


class Expert(nn.Module):
    """One expert: the GPT's MLP (chapter 01), its own weights."""

    def __init__(self, n_embd: int, hidden: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.c_proj.residual_scale = True  # GPT._init_weights scales it by depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class MoE(nn.Module):
    """A drop-in for the GPT's MLP: (B, T, C) in, (B, T, C) out. `n_experts` experts of
    `hidden` units, `top_k` chosen per token, `capacity_factor` (0: dropless). `group`: the
    ranks whose tokens form the micro-batch (None: this process alone). After each forward,
    `aux_sum` is balance_sum (a tensor with the router's gradient), and `stats` holds the
    choices each expert received and how many were dropped, over the whole micro-batch."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int = 2, hidden: int | None = None,
                 capacity_factor: float = 0.0, bias: bool = True, group=None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if not 0 <= capacity_factor < math.inf:
            raise ValueError(f"capacity_factor={capacity_factor} must be finite and >= 0 (0: dropless)")
        self.n_experts, self.top_k, self.capacity_factor, self.group = n_experts, top_k, capacity_factor, group
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        # by global index, so a checkpoint names expert e alike however the experts are spread
        self.experts = nn.ModuleDict({str(e): Expert(n_embd, hidden or 4 * n_embd, bias)
                                      for e in range(n_experts)})
        self.aux_sum, self.stats = None, None

    def counts_before(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this micro-batch's choices per expert over all ranks, those made on earlier
        ranks): one all-gather of E counts (nothing to send in one process)."""
        if self.group is None:
            return chosen, torch.zeros_like(chosen)
        every = [torch.empty_like(chosen) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, chosen, group=self.group)
        every = torch.stack(every)
        return every.sum(0), every[:dist.get_rank(self.group)].sum(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.router.in_features:
            raise ValueError(f"MoE takes (B, T, {self.router.in_features}) activations, got {tuple(x.shape)}")
        B, T, C = x.shape
        h = x.reshape(B * T, C)
        probs, gates, experts = route(self.router(h), self.top_k)
        E, k = self.n_experts, self.top_k
        chosen = torch.bincount(experts.reshape(-1), minlength=E)
        total, offset = self.counts_before(chosen)
        cap = capacity(int(total.sum()) // k, E, k, self.capacity_factor)
        keep = keep_first(experts, E, cap, offset).reshape(-1)
        # dispatch: the kept choices sorted by expert (stable: token order within an expert)
        token = torch.arange(B * T, device=x.device).repeat_interleave(k)[keep]
        expert, gate = experts.reshape(-1)[keep], gates.reshape(-1)[keep]
        order = torch.argsort(expert, stable=True)
        token, expert, gate = token[order], expert[order], gate[order]
        y = self.run_experts(h[token], torch.bincount(expert, minlength=E))
        # combine: each result back to its token, weighted by its gate (the router learns
        # here), summed in fp32 whatever the experts' dtype under autocast
        out = h.new_zeros(h.shape, dtype=torch.float32).index_add(0, token, y.float() * gate[:, None])
        self.aux_sum = balance_sum(probs, total.float() / total.sum())
        kept = total if cap is None else total.clamp(max=cap)
        self.stats = {"tokens": total.tolist(), "dropped": int((total - kept).sum())}
        return out.view(B, T, C).to(x.dtype)

    def run_experts(self, xs: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Each expert on its contiguous block of `xs` (per_expert[e] rows for expert e)."""
        blocks = xs.split(per_expert.tolist())
        return torch.cat([self.experts[str(e)](b) for e, b in enumerate(blocks)])
