"""Exercise 01 solved the way chapter 01 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

from minidist.model import GPTConfig


def count_params(cfg: GPTConfig) -> int:
    """Number of distinct parameters of GPT(cfg) (minidist/model.py), each counted once
    (a tied parameter is one parameter), with cfg.bias on or off."""
    d, b = cfg.n_embd, int(cfg.bias)
    layer_norm = d + b * d                       # gain, and a bias with cfg.bias
    attention = (3 * d * d + b * 3 * d) + (d * d + b * d)         # qkv, then the output
    mlp = (4 * d * d + b * 4 * d) + (4 * d * d + b * d)           # up, then down
    block = 2 * layer_norm + attention + mlp
    # token table (also the tied head), position table, the blocks, the final LayerNorm
    return cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * block + layer_norm


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, the PaLM paper's estimate
    6 * N + 12 * n_layer * seq_len * n_embd, where N is the parameter count without the
    position table. seq_len, not cfg.block_size: a model can train on shorter sequences."""
    n = count_params(cfg) - cfg.block_size * cfg.n_embd  # a lookup does no arithmetic
    return 6 * n + 12 * cfg.n_layer * seq_len * cfg.n_embd


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None,
        n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: the fraction of the hardware's peak the model uses.
    `tokens_per_s` is the throughput of the whole run (all devices together),
    `peak_flops` the peak FLOP/s of one device. None when the peak is unknown (None or 0)."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_s / (peak_flops * n_devices)


# Where minidist implements each function; `python -m exercises.grade 01 --reference`
# grades these instead of the stubs above. Leave it as it is.
REFERENCE = {
    "count_params": "minidist.model:config_num_params",
    "flops_per_token": "minidist.model:flops_per_token",
    "mfu": "minidist.metrics:mfu",
}
