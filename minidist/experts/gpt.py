"""The GPT with mixture-of-experts MLPs, and its accounting. Chapter 13
(chapters/13_experts.md); `python minidist/train_gpt.py --n-experts 4 --top-k 2` trains it,
`pytest tests/test_experts.py` checks it.

MoEGPT is chapter 01's GPT with the MLP of every `every`-th block replaced by an MoE
(minidist/experts/moe.py); its training loss adds `aux_loss_weight` times the layers'
balance losses (evaluation reports the cross-entropy alone, comparable with a dense GPT).
Parameters: the total (every expert) is what memory holds; the active ones (k experts per
token and the router) are what a token's FLOPs cost, chapter 01's 6N with N the active count.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass

import torch

from minidist.model import GPT, GPTConfig, config_num_params, flops_per_token

from .moe import MoE


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 0.0   # 0: dropless; else slots = factor x the even share
    aux_loss_weight: float = 0.01  # Switch Transformer's alpha
    every: int = 1                 # an MoE in blocks every-1, 2*every-1, ... (1: all)
    hidden: int | None = None      # an expert's hidden width (None: 4 x n_embd, the dense MLP's)

    def __post_init__(self):
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"need n_experts >= 1 and 1 <= top_k <= n_experts, got n_experts="
                             f"{self.n_experts}, top_k={self.top_k}")
        if not (0 <= self.capacity_factor < math.inf and 0 <= self.aux_loss_weight < math.inf) or self.every < 1:
            raise ValueError("capacity_factor and aux_loss_weight must be finite and >= 0, every >= 1, got "
                             f"{self.capacity_factor}, {self.aux_loss_weight}, {self.every}")

    def to_dict(self) -> dict:
        return asdict(self)


def moe_blocks(cfg: GPTConfig, moe: MoEConfig) -> list[int]:
    """The blocks whose MLP is an MoE."""
    return [i for i in range(cfg.n_layer) if i % moe.every == moe.every - 1]


class MoEGPT(GPT):
    """GPT(cfg) with MoE MLPs; `group`: the ranks whose tokens form each micro-batch (None:
    one process; minidist/experts/parallel.py spreads the experts)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, group=None):
        super().__init__(cfg)
        self.moe = moe
        for i in moe_blocks(cfg, moe):
            layer = MoE(cfg.n_embd, moe.n_experts, moe.top_k, moe.hidden, moe.capacity_factor, cfg.bias, group)
            layer.apply(self._init_weights)  # GPT-2's init, the depth-scaled projections included
            self.blocks[i].mlp = layer

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        """GPT's head; in training, the loss plus aux_loss_weight x the balance losses (in the
        loss's units: summed over tokens for reduction="sum", as chapter 04 normalises)."""
        logits, loss = super().head(x, targets, reduction)
        if loss is None or not self.training or not self.moe.aux_loss_weight:
            return logits, loss
        aux = sum(m.aux_sum for m in self.moe_layers())
        if reduction == "mean":
            aux = aux / (x.shape[0] * x.shape[1])
        return logits, loss + self.moe.aux_loss_weight * aux

    def describe(self) -> str:
        m = self.moe
        cap = f"capacity {m.capacity_factor:g}" if m.capacity_factor else "dropless"
        return (f"experts | {m.n_experts} experts, top-{m.top_k}, {cap}, aux weight {m.aux_loss_weight:g}, "
                f"in {len(self.moe_layers())} of {self.config.n_layer} blocks")


def expert_stats(model) -> str:
    """The last forward's routing, for the log: "L0 12/9/7/4 drop 0 | L1 ..." (choices per expert)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.stats]
    return " | ".join(f"L{i} {'/'.join(map(str, m.stats['tokens']))} drop {m.stats['dropped']}"
                      for i, m in enumerate(layers))


def _per_block(cfg: GPTConfig, moe: MoEConfig, experts_counted: int) -> int:
    """Parameters an MoE block has beyond a dense block's, counting `experts_counted` experts."""
    d, b, h = cfg.n_embd, int(cfg.bias), moe.hidden or 4 * cfg.n_embd
    expert = 2 * d * h + h * b + d * b
    dense = 8 * d * d + 4 * d * b + d * b
    return experts_counted * expert - dense + d * moe.n_experts  # + the router


def moe_num_params(cfg: GPTConfig, moe: MoEConfig, active: bool = False) -> int:
    """The MoE GPT's parameters from the formula: every expert, or (active) the top_k a token uses."""
    extra = _per_block(cfg, moe, moe.top_k if active else moe.n_experts)
    return config_num_params(cfg) + len(moe_blocks(cfg, moe)) * extra


def moe_flops_per_token(cfg: GPTConfig, moe: MoEConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: chapter 01's estimate with the active parameters (a token
    runs through k experts and the router, never the other E - k)."""
    return flops_per_token(cfg, seq_len) + 6 * len(moe_blocks(cfg, moe)) * _per_block(cfg, moe, moe.top_k)
