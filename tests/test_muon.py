"""Muon (minidist.muon, minidist.muon.orthogonalize): Newton-Schulz against the SVD and its own
scalar polynomials (Keller Jordan's and the Polar Express schedule), batched against one by
one, Muon against torch.optim.Muon, distributed Muon at 2, 3 and 4 ranks against one
process, the parameter split and the routing check with each failure class it exists for,
and train_gpt --optimizer muon on 2 ranks against 1."""

import numpy as np
import pytest
import torch

from minidist import train_gpt
from minidist.model import GPT, GPTConfig
from minidist.muon import NS_COEFFICIENTS, Muon, check_routing, newton_schulz, split_params
from minidist.muon.plain import PlainMuon
from minidist.muon.orthogonalize import POLAR_EXPRESS, POLAR_EXPRESS_MARGIN, newton_schulz_many


def _poly(s, steps, schedule=None):
    """The scalar map Newton-Schulz applies to each (normalised) singular value."""
    for a, b, c in schedule or [NS_COEFFICIENTS] * steps:
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


def test_polar_express_applies_its_schedule_and_ends_in_a_narrower_band():
    """Polar Express: a different quintic per step, after dividing by 1.02 ||G||_F. Same
    fp32 check as above, with the composed schedule; then the band, from the scalar maps:
    from every start in [1e-3, 1] it ends inside Jordan's band, narrower at both ends."""
    s = np.geomspace(1e-3, 1.0, 48)
    G, U, V = _with_singular_values(s, 48, 96)
    O = newton_schulz(G.float(), dtype=torch.float32, coefficients="polar_express").double()
    expected = _poly(s / (np.linalg.norm(s) * POLAR_EXPRESS_MARGIN), 5, POLAR_EXPRESS)
    torch.testing.assert_close(torch.diagonal(U.T @ O @ V), torch.as_tensor(expected), atol=2e-5, rtol=1e-4)
    grid = np.geomspace(1e-3, 1, 100_001)
    jordan, polar = _poly(grid, 5), _poly(grid / POLAR_EXPRESS_MARGIN, 5, POLAR_EXPRESS)
    assert jordan.min() < polar.min() and polar.max() < jordan.max()
    # random matrices land in the scalar band (bf16 rounding: a little either side)
    X = torch.randn(3, 64, 256, generator=torch.Generator().manual_seed(2))
    for dtype, slack in ((torch.float32, 1e-3), (torch.bfloat16, 1e-2)):
        sv = torch.linalg.svdvals(newton_schulz(X, dtype=dtype, coefficients="polar_express").float())
        assert polar.min() - slack < sv.min() and sv.max() < polar.max() + slack
    with pytest.raises(ValueError, match="polar_express schedule has 5 steps"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_steps=6, ns_coefficients="polar_express")
    with pytest.raises(ValueError, match="coefficients must be"):
        newton_schulz(X, coefficients="quintic")


def test_batched_newton_schulz_equals_one_by_one():
    """One chain per shape group, tall matrices joining their transposes' group. Each
    matrix keeps its own norm, so the mathematics is each matrix's own; what may differ is
    rounding, if a batched kernel splits its sums differently (a GPU's may). That moves
    each product by about one bf16 rounding, the same kind of error as computing in bf16
    at all, so the bound is the bf16-against-fp32 one above (3%). On this CPU the
    kernel per matrix is the same, and so are the bits."""
    g = torch.Generator().manual_seed(3)
    shapes = [(96, 32), (32, 96), (96, 32), (48, 48), (48, 48), (16, 64), (40, 24)]
    Ms = [torch.randn(*s, generator=g) for s in shapes]
    for coefficients in ("jordan", "polar_express"):
        batched = newton_schulz_many(Ms, coefficients=coefficients)
        for M, B in zip(Ms, batched):
            one = newton_schulz(M, coefficients=coefficients)
            assert B.shape == M.shape and B.dtype == torch.bfloat16
            assert torch.linalg.matrix_norm(B.float() - one.float()) < 0.03 * torch.linalg.matrix_norm(one.float())
            assert torch.equal(B, one)  # CPU: the same bits


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


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("kw", [
    dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1),
    dict(lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.05, momentum=0.95, nesterov=True, weight_decay=0.01, adjust_lr_fn="original", ns_steps=3),
])
def test_muon_equals_torch_optim_muon(kw, batched):
    """Same arithmetic as torch 2.13's Muon (bf16 Newton-Schulz), so equal to the bit:
    one by one (batched=False), and batched by shape, which on this CPU is the same bits."""
    ours, _ = _run(lambda ps: Muon(ps, batched=batched, **kw))
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, **kw))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], _params()[0])


def test_muon_refuses_what_it_cannot_optimise():
    with pytest.raises(ValueError, match="split_params"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(_params(), adjust_lr_fn="rms")
    for bad in (dict(lr=-1.0), dict(lr=float("nan")), dict(momentum=1.0), dict(weight_decay=float("inf"))):
        for kind in (Muon, PlainMuon):
            with pytest.raises(ValueError, match="need a finite lr >= 0"):  # nan passes every comparison
                kind(_params(), **bad)


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
def test_distributed_muon_equals_one_process(world, pool):
    """Each matrix is orthogonalised by its owner and all-gathered: the result must be
    one process's, to the bit (the same operations on the same values), in fp32 and bf16;
    the momentum is spread over the ranks."""
    results = pool(world).run(_distributed)  # the session's ranks (tests/conftest.py)
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


def _tiny_gpt():
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))


def _flatten(module, names=None):
    """Replace parameters by flat 1-D copies, as a flat shard or ZeRO-3's init leaves them."""
    for mod in module.modules():
        for n, p in list(mod.named_parameters(recurse=False)):
            if names is None or n in names:
                setattr(mod, n, torch.nn.Parameter(p.detach().flatten()))


def _shape_router(model):
    """The rule that breaks: 2-D and not an embedding or the head (minus the flattening)."""
    skip = {id(model.wte.weight), id(model.wpe.weight)}
    hidden = [p for p in model.parameters() if p.dim() == 2 and id(p) not in skip]
    return hidden, [p for p in model.parameters() if id(p) not in {id(h) for h in hidden}]


def _step(model, opts):
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    for o in opts:
        o.step()


def test_check_routing_passes_the_right_routing_and_catches_each_failure_class():
    model = _tiny_gpt()
    hidden, rest = split_params(model)
    opts = [torch.optim.AdamW(rest), Muon(hidden)]
    with pytest.raises(RuntimeError, match=r"blocks.0.attn.c_attn.weight .*\(no Muon holding it has stepped\)"):
        check_routing(model, opts)  # Muon built but never stepped (a wrapper stepped something else)
    _step(model, opts)
    check_routing(model, opts)  # the right routing passes

    # a flat 1-D shard reaching the router: split_params refuses it; a shape rule sends it to AdamW
    model = _tiny_gpt()
    _flatten(model.blocks[0].attn.c_attn, {"weight"})
    with pytest.raises(ValueError, match="blocks.0.attn.c_attn.weight is a weight matrix but has shape"):
        split_params(model)
    hidden, rest = _shape_router(model)
    opts = [torch.optim.AdamW(rest), Muon(hidden)]
    _step(model, opts)
    with pytest.raises(RuntimeError, match=r"blocks.0.attn.c_attn.weight \(3072,\) is a hidden matrix but "
                                           r"AdamW holds it \(it is 1-D here"):
        check_routing(model, opts)

    # every parameter looks 1-D (as ZeRO-3's init can leave them): Muon gets nothing at all
    model = _tiny_gpt()
    _flatten(model)
    hidden, rest = _shape_router(model)
    assert hidden == []
    opts = [torch.optim.AdamW(rest)]
    _step(model, opts)
    with pytest.raises(RuntimeError, match=r"(?s)blocks.0.attn.c_attn.weight.*AdamW holds it.*and 3 more"):
        check_routing(model, opts)

    # an `ndim >= 2` rule sends the embeddings (and the head tied to wte) to Muon
    model = _tiny_gpt()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    opts = [torch.optim.AdamW([p for p in model.parameters() if p.dim() < 2]), Muon(matrices)]
    _step(model, opts)
    with pytest.raises(RuntimeError, match=r"wte.weight \(64, 32\) was updated by Muon but is not a hidden"):
        check_routing(model, opts)

    # Muon never ran: plain SGD trained the matrices (or AdamW everything)
    model = _tiny_gpt()
    hidden, rest = split_params(model)
    for opts, who in (([torch.optim.AdamW(rest), torch.optim.SGD(hidden, lr=0.1)], "SGD"),
                      ([torch.optim.AdamW(model.parameters())], "AdamW")):
        _step(model, opts)
        with pytest.raises(RuntimeError, match=f"blocks.0.mlp.c_proj.weight .* but {who} holds it"):
            check_routing(model, opts)


def test_train_gpt_muon_two_ranks_equals_one(tmp_path, pool):
    argv = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
            "--tokenizer", "gpt2-512", "--lr", "3e-3", "--warmup-steps", "2", "--eval-windows",
            "8", "--final-eval-windows", "32", "--sample-tokens", "4", "--log-interval", "1",
            "--device", "cpu", "--steps", "6", "--batch-size", "8", "--eval-interval", "100",
            "--optimizer", "muon", "--out-dir", str(tmp_path)]
    one = train_gpt.main(argv)
    two = pool(2).run(train_gpt.main, argv)  # the session's ranks (tests/conftest.py)
    losses = lambda s: [r["loss"] for r in s["rows"] if "loss" in r]
    for s in two:
        assert losses(s) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
    assert losses(one)[-1] < losses(one)[0]
