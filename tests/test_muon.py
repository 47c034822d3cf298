"""Muon (minidist.muon): Newton-Schulz against the SVD and its own scalar polynomial,
Muon against torch.optim.Muon, distributed Muon at 2, 3 and 4 ranks against one process,
the parameter split, and train_gpt --optimizer muon on 2 ranks against 1."""

import numpy as np
import pytest
import torch

from minidist import train_gpt
from minidist.launch import launch
from minidist.model import GPT, GPTConfig
from minidist.muon import NS_COEFFICIENTS, Muon, newton_schulz, split_params


def _poly(s, steps):
    """The scalar map Newton-Schulz applies to each (normalised) singular value."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def _with_singular_values(s, m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, len(s), generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, len(s), generator=g, dtype=torch.float64))
    return (U * torch.as_tensor(s, dtype=torch.float64)) @ V.T, U, V


@pytest.mark.parametrize("m, n", [(48, 96), (96, 48), (64, 64)])
def test_newton_schulz_maps_each_singular_value_by_the_polynomial(m, n):
    """In exact arithmetic NS keeps U and V and sends each singular value s to
    p(p(...p(s / ||G||_F))). Check that, in fp32, on a spread of singular values."""
    s = np.geomspace(1e-3, 1.0, min(m, n))
    G, U, V = _with_singular_values(s, m, n)
    O = newton_schulz(G.float(), dtype=torch.float32).double()
    expected = _poly(s / np.linalg.norm(s), 5)
    core = U.T @ O @ V  # diagonal, with p^5 of each singular value, if U and V are kept
    torch.testing.assert_close(torch.diagonal(core), torch.as_tensor(expected), atol=2e-5, rtol=1e-4)
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 2e-5
    assert torch.linalg.matrix_rank(O - U @ core @ V.T, atol=1e-4) == 0  # nothing outside span


def test_singular_values_land_in_the_quintic_band_and_bf16_stays_close():
    # the band, measured from the polynomial itself: where p^k settles from (1e-3, 1]
    grid = _poly(np.linspace(1e-3, 1, 200_001), 30)
    lo, hi = grid.min(), grid.max()
    assert 0.67 < lo < 0.69 and 1.12 < hi < 1.14  # the published "about 0.68 to 1.13"
    g = torch.Generator().manual_seed(1)
    G = torch.randn(3, 64, 256, generator=g)  # a batch of well-conditioned wide matrices
    O32 = newton_schulz(G, dtype=torch.float32)
    sv = torch.linalg.svdvals(O32)
    assert sv.min() > lo - 1e-3 and sv.max() < hi + 1e-3
    # against the exact polar factor U V^T: the distance is what the band allows, no more
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.linalg.matrix_norm(O32 - U @ Vh, ord=2).max() < max(1 - lo, hi - 1) + 1e-3
    # bf16 (8 significant bits) against fp32: a few bf16 roundings, relative
    O16 = newton_schulz(G)
    assert O16.dtype == torch.bfloat16
    rel = torch.linalg.matrix_norm(O16.float() - O32) / torch.linalg.matrix_norm(O32)
    assert rel.max() < 0.03
    # batched equals one by one; a tall matrix is the transpose of the wide case
    torch.testing.assert_close(O32[2], newton_schulz(G[2], dtype=torch.float32), atol=1e-6, rtol=0)
    torch.testing.assert_close(newton_schulz(G[0].T, dtype=torch.float32), O32[0].T, atol=1e-6, rtol=0)
    assert torch.equal(newton_schulz(torch.zeros(8, 4)), torch.zeros(8, 4, dtype=torch.bfloat16))


SHAPES = [(64, 32), (32, 64), (48, 48), (96, 32), (16, 16), (32, 96)]


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _run(make_opt, steps=5):
    """`steps` optimizer steps on seeded gradients; parameter 2 has no gradient at step 1."""
    ps = _params()
    opt = make_opt(ps)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 + t)
        for i, p in enumerate(ps):
            p.grad = None if (t == 1 and i == 2) else torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in ps], opt


@pytest.mark.parametrize("kw", [
    dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1),
    dict(lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.05, momentum=0.95, nesterov=True, weight_decay=0.01, adjust_lr_fn="original", ns_steps=3),
])
def test_muon_equals_torch_optim_muon(kw):
    """Same arithmetic as torch 2.13's Muon (bf16 Newton-Schulz), so equal to the bit."""
    ours, _ = _run(lambda ps: Muon(ps, **kw))
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, **kw))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], _params()[0])


def test_muon_refuses_what_it_cannot_optimise():
    with pytest.raises(ValueError, match="split_params"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(_params(), adjust_lr_fn="rms")


def _distributed():
    import torch.distributed as dist
    torch.set_num_threads(1)  # as the oracle: fp32 matmul sums in an order set by threads
    result = {}
    for ns_dtype in (torch.float32, torch.bfloat16):
        out, opt = _run(lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype))
        momentum = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
        result[ns_dtype] = (dist.get_world_size(), out, momentum)
    return result


@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_muon_equals_one_process(world):
    """Each matrix is orthogonalised by its owner and all-gathered: the result must be
    one process's, to the bit (the same operations on the same values), in fp32 and bf16;
    the momentum is spread over the ranks."""
    results = launch(_distributed, world)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        oracle = {d: _run(lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=d))[0]
                  for d in (torch.float32, torch.bfloat16)}
    finally:
        torch.set_num_threads(threads)
    for ns_dtype in (torch.float32, torch.bfloat16):
        one = oracle[ns_dtype]
        total = sum(p.numel() * 4 for p in _params())
        for n, out, momentum in (r[ns_dtype] for r in results):
            assert n == world and all(torch.equal(a, b) for a, b in zip(out, one))
            # whole matrices per rank: about 1/N each, the largest share bounded by one matrix
            assert momentum < total / world + max(p.numel() * 4 for p in _params())
            assert momentum > 0


def test_split_params_gives_muon_the_hidden_matrices_only():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    muon, adamw = split_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in muon) and len(muon) == 2 * 4  # qkv, proj, fc, proj / layer
    assert not any("wte" in names[id(p)] or "wpe" in names[id(p)] for p in muon)
    assert {id(p) for p in muon} | {id(p) for p in adamw} == set(names)  # each once
    assert not {id(p) for p in muon} & {id(p) for p in adamw}


def test_train_gpt_muon_two_ranks_equals_one(tmp_path):
    argv = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
            "--tokenizer", "gpt2-512", "--lr", "3e-3", "--warmup-steps", "2", "--eval-windows",
            "8", "--final-eval-windows", "32", "--sample-tokens", "4", "--log-interval", "1",
            "--device", "cpu", "--steps", "6", "--batch-size", "8", "--eval-interval", "100",
            "--optimizer", "muon", "--out-dir", str(tmp_path)]
    one = train_gpt.main(argv)
    two = launch(train_gpt.main, 2, argv)
    losses = lambda s: [r["loss"] for r in s["rows"] if "loss" in r]
    for s in two:
        assert losses(s) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
    assert losses(one)[-1] < losses(one)[0]
