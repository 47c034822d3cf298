"""Exercise 01 (warm-up): count what a GPT costs, before spending any of it.

Chapter 01 (chapters/01_gpt.md) builds the GPT of minidist/model.py and measures its
training speed as MFU. Every later chapter reasons with the three numbers below: how many
parameters a model has (memory, chapter 06), how many FLOPs a token costs (time, chapter
08), and what fraction of the hardware a run uses (MFU, every log line).

Implement the three functions, replacing each `raise NotImplementedError(...)`:

- count_params(cfg):           distinct parameters of `minidist.model.GPT(cfg)`
- flops_per_token(cfg, T):     training FLOPs per token at sequence length T
- mfu(fpt, tokens_per_s, ...): model FLOPs utilisation

Rule, enforced in every check (a check that breaks it scores 0): work from the config
alone, build no model (minidist.model.GPT trips while your code runs; the grader builds
the models and checks your formula against them, up to GPT-2 XL's 1.5 billion
parameters).

Grade your work with

    python -m exercises.grade 01

(about 4 s of CPU time, in this one process: it builds models up to GPT-2 XL's size on
the meta device and counts one small model's FLOPs), and see what full marks look like with `python -m exercises.grade 01 --reference`,
which grades minidist's own implementations (named in REFERENCE below) instead of yours.
Ask for a hint on the first failing check with `python -m exercises.grade 01 --hint`
(again for the next one; `--hint K` for the K-th).
"""

from __future__ import annotations

from minidist.model import GPTConfig


def count_params(cfg: GPTConfig) -> int:
    """Number of distinct parameters of `GPT(cfg)` (minidist/model.py), each counted once
    (a tied parameter is one parameter), with cfg.bias on or off. The grader compares
    with the models it builds, small ones and GPT-2's presets."""
    raise NotImplementedError(
        "count_params is not written yet (`python -m exercises.grade 01 --hint` gives a hint)")


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, the PaLM-paper estimate.

    6 * N + 12 * n_layer * seq_len * n_embd, where N is the parameter count without the
    position table (a lookup does no arithmetic). T is `seq_len`, not cfg.block_size: a
    model can train on shorter sequences. Chapter 01, section 3, derives it; the grader also
    compares with FLOPs counted on a real forward and backward.
    """
    raise NotImplementedError(
        "flops_per_token is not written yet (`python -m exercises.grade 01 --hint` gives a hint)")


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None,
        n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: the fraction of the hardware's peak the model uses.

    `tokens_per_s` is the throughput of the whole run (all devices together),
    `peak_flops` the peak FLOP/s of one device (chapter 01, section 5). Return None when
    the peak is unknown (None or 0): an MFU against a made-up peak would mislead.
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
