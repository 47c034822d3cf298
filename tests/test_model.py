"""minidist.model and minidist.metrics: counts, causality, attention against a written-out
oracle, masking, sampling, and the MFU arithmetic."""

import math

import pytest
import torch
import torch.nn.functional as F

from minidist import metrics
from minidist.model import GPT, PRESETS, GPTConfig, config_num_params, flops_per_token, num_params

SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=97)


@pytest.mark.parametrize("cfg", [GPTConfig(**SMALL), GPTConfig(**{**SMALL, "bias": False}),
                                 GPTConfig(vocab_size=2048, **PRESETS["tiny"])])
def test_param_count_formula_matches_the_model(cfg):
    m = GPT(cfg)
    by_hand = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
    assert num_params(m) == config_num_params(cfg) == by_hand
    assert num_params(m, non_embedding=True) == by_hand - cfg.block_size * cfg.n_embd


def test_gpt2_small_is_124m():
    # GPT-2 small's published size: 124M parameters (Radford et al., 2019; HF model card)
    assert round(config_num_params(GPTConfig()) / 1e6) == 124


def test_head_is_tied_to_embedding():
    m = GPT(GPTConfig(**SMALL))
    assert m.lm_head.weight is m.wte.weight
    assert len(list(m.parameters())) == len({id(p) for p in m.parameters()})


def test_attention_equals_written_out_causal_softmax():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**SMALL)).eval()
    attn = m.blocks[0].attn
    x = torch.randn(3, 10, 32)
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(C // 2)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    torch.testing.assert_close(attn(x), attn.c_proj(y), rtol=1e-5, atol=1e-6)


def test_future_tokens_do_not_leak():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**SMALL)).eval()
    a = torch.randint(0, 97, (2, 16))
    b = a.clone()
    b[:, 9:] = torch.randint(0, 97, (2, 7))
    la, lb = m(a)[0], m(b)[0]
    torch.testing.assert_close(la[:, :9], lb[:, :9])
    assert not torch.allclose(la[:, 9:], lb[:, 9:])


def test_masked_targets_are_ignored_and_sum_matches_mean():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**SMALL))
    x = torch.randint(0, 97, (2, 16))
    y = x.roll(-1, 1)
    y[0, 5:] = -1
    logits, mean = m(x, y)
    _, total = m(x, y, reduction="sum")
    keep = y != -1
    oracle = F.cross_entropy(logits[keep], y[keep], reduction="sum")
    torch.testing.assert_close(total, oracle)
    torch.testing.assert_close(mean * keep.sum(), total)


def test_generate_is_reproducible_and_bounded():
    m = GPT(GPTConfig(**SMALL))
    p = torch.zeros(1, 3, dtype=torch.long)
    a = m.generate(p, 20, top_k=5, generator=torch.Generator().manual_seed(1))
    b = m.generate(p, 20, top_k=5, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 23) and torch.equal(a, b) and int(a.max()) < 97


def test_bad_config_and_long_input_are_clear_errors():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="block_size"):
        GPT(GPTConfig(**SMALL))(torch.zeros(1, 17, dtype=torch.long))


def test_flops_per_token_matches_counted_matmul_flops():
    """Oracle: torch's FlopCounterMode counts the matmuls of a real forward + backward.
    The 6N + 12LTd estimate leaves out LayerNorm, GELU, softmax and bias adds; without
    biases, the two differ only by the LayerNorm gains that N includes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=512, bias=False)
    m = GPT(cfg)
    x = torch.randint(0, 512, (2, 32))
    # the math backend spells attention out as two batched matmuls the counter sees (the
    # fused CPU kernel is invisible to it); it computes the full T x T square, as 6N+12LTd assumes
    with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
        m(x, x)[1].backward()
    counted = fc.get_total_flops() / x.numel()
    estimate = flops_per_token(cfg, 32)
    # the estimate's only extra is 6 FLOPs for each LayerNorm gain it counts in N
    ln_gains = (2 * cfg.n_layer + 1) * cfg.n_embd
    assert estimate - counted == 6 * ln_gains, (counted, estimate)


def test_mfu_arithmetic_and_peak_table():
    assert metrics.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert metrics.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 156e12
    assert metrics.gpu_peak_flops("Some Other GPU") is None
    assert metrics.mfu(6e9, 1000, 1e13, 2) == pytest.approx(6e12 / 2e13)
    assert metrics.mfu(6e9, 1000, None) is None
    assert metrics.mfu_text(0.045) == "4.5%" and metrics.mfu_text(None) == "n/a"
    assert metrics.mfu_text(1.043) == "104.3% (above the measured peak: it was measured low)"
    assert metrics.measure_cpu_peak_flops() > 1e8  # a real measurement, not a constant
