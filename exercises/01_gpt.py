"""Exercise 01 (warm-up): count what a GPT costs, before spending any of it.

Chapter 01 (chapters/01_gpt.md) builds the GPT of minidist/model.py and measures its
training speed as MFU. Every later chapter reasons with the three numbers below: how many
parameters a model has (memory, chapter 06), how many FLOPs a token costs (time, chapter
08), and what fraction of the hardware a run uses (MFU, every log line).

Implement the three functions, replacing each `raise NotImplementedError(...)`:

- count_params(cfg):           distinct parameters of `minidist.model.GPT(cfg)`
- flops_per_token(cfg, T):     training FLOPs per token at sequence length T
- mfu(fpt, tokens_per_s, ...): model FLOPs utilisation

Work from the config alone: build no model (the grader builds the models and checks
your formula against them, up to GPT-2 XL's 1.5 billion parameters).

Grade your work with

    python -m exercises.grade 01

and see what full marks look like with `python -m exercises.grade 01 --reference`,
which grades minidist's own implementations (named in REFERENCE below) instead of yours.
Ask for a hint on the first failing check with `python -m exercises.grade 01 --hint`
(again for the next one; `--hint K` for the K-th).
"""

from __future__ import annotations

from minidist.model import GPTConfig


def count_params(cfg: GPTConfig) -> int:
    """Number of distinct parameters of `GPT(cfg)`.

    Count every Parameter once: the token embedding (vocab_size x n_embd), the position
    table (block_size x n_embd), per block two LayerNorms, the qkv and output projections
    of attention and the two MLP matrices, then the final LayerNorm. The head is tied to
    the token embedding, so it adds nothing. `cfg.bias` switches the biases of every
    Linear and LayerNorm on or off (a LayerNorm always has its gain).
    """
    raise NotImplementedError(
        "count_params is not written yet (`python -m exercises.grade 01 --hint` gives a hint)")


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, the PaLM-paper estimate.

    6 * N + 12 * n_layer * seq_len * n_embd, where
    - N is the parameter count without the position table: a lookup does no
      arithmetic, while the token table does (as the tied head it is a matmul);
    - 6 = 2 FLOPs per multiply-add in the forward matmul, 4 in the backward (gradients
      with respect to the input and to the weight);
    - 12 * L * T * d is attention's own work (scores q @ k^T and the weighted sum of
      values, each 2 * T * d per token per layer forward, times 3 with backward), counted
      over the full T x T square although the causal mask leaves half of it unused.
    Use `seq_len`, not cfg.block_size, for T: a model can train on shorter sequences.
    """
    raise NotImplementedError(
        "flops_per_token is not written yet (`python -m exercises.grade 01 --hint` gives a hint)")


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None,
        n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: the fraction of the hardware's peak the model uses.

    `tokens_per_s` is the throughput of the whole run (all devices together),
    `peak_flops` the peak FLOP/s of one device. Return None when the peak is unknown
    (None or 0): an MFU against a made-up peak would mislead.
    """
    raise NotImplementedError(
        "mfu is not written yet (`python -m exercises.grade 01 --hint` gives a hint)")


# Where minidist implements each function; `python -m exercises.grade 01 --reference`
# grades these instead of the stubs above. Leave it as it is.
REFERENCE = {
    "count_params": "minidist.model:config_num_params",
    "flops_per_token": "minidist.model:flops_per_token",
    "mfu": "minidist.metrics:mfu",
}
