"""The plain forms the library opens with (minidist.BOOK) equal its optimised classes and one
process: minidist.zero.simple's zero1_step, zero2_step and zero3_step against ShardedOptimizer
(stages 1, 2) and FullyShardedOptimizer and one process's AdamW; minidist.muon.plain's
newton_schulz and PlainMuon (one all-gather per round) against minidist.muon's (bucketed,
overlapped) and one process's Muon; minidist.checkpoint.plain's save/load against
minidist.checkpoint's, a round trip through each giving back the same model and optimizer
state. One call of the session's 2-rank pool runs every multi-process case (tests/conftest.py)."""

import torch

from helpers import micro_batches, tiny_gpt, token_batch

BATCH, SEQ, VOCAB, STEPS = 8, 16, 64, 2
# eps 1e-4: the key projection's bias has an exactly zero gradient, so what arrives is
# rounding noise that eps 1e-8 would blow up differently for each summation order
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4)
MUON = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)


def _zero(stage: int, plain: bool):
    """This rank's final parameters after STEPS steps on its share of each global batch."""
    import torch.distributed as dist

    from minidist.zero import FullyShardedOptimizer, ShardedOptimizer
    from minidist.zero.simple import gather, make_unit, shard_per_block, zero1_step, zero2_step, zero3_step
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt(0)
    params = list(model.parameters())
    if plain:
        units = shard_per_block(model) if stage == 3 else [make_unit(params)]
        opt = torch.optim.AdamW([u.shard for u in units], **ADAMW)
    elif stage == 3:
        opt = FullyShardedOptimizer(model, params, torch.optim.AdamW, **ADAMW)
    else:
        opt = ShardedOptimizer(params, torch.optim.AdamW, stage=stage, reduce_gradients=True,
                               module=model, **ADAMW)
    for step in range(STEPS):
        (x, y), = micro_batches(*token_batch(step, BATCH, SEQ, VOCAB), rank, world)
        model(x, y)[1].backward()
        if not plain:
            opt.step()
            opt.zero_grad()
            continue
        {1: zero1_step, 2: zero2_step, 3: zero3_step}[stage](units if stage == 3 else units[0], opt)
        for p in params:
            p.grad = None
    if stage == 3 and plain:
        for u in units:
            gather(u)  # only to read the parameters
    if stage == 3 and not plain:
        with opt.gathered():
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def _muon(plain: bool):
    from minidist.muon import Muon
    from minidist.muon.plain import PlainMuon
    from test_muon import _run
    return _run(lambda ps: (PlainMuon if plain else Muon)(ps, **MUON))[0]


def _state(model, opts):
    """The parameters, each optimizer's state per parameter, and its hyperparameters."""
    clone = lambda v: v.detach().clone() if torch.is_tensor(v) else v
    return ([clone(p) for p in model.parameters()],
            [[{k: clone(v) for k, v in o.state.get(p, {}).items()} for g in o.param_groups for p in g["params"]]
             for o in opts],
            [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in opts])


def _checkpoints(folder: str):
    """This rank's state after one step of Muon (its momenta at their owners) and AdamW,
    then after a round trip through minidist.checkpoint.plain, then through minidist.checkpoint."""
    import torch.distributed as dist

    from minidist import checkpoint
    from minidist.checkpoint import plain
    from minidist.muon import Muon, split_params
    rank, world = dist.get_rank(), dist.get_world_size()

    def build(seed):
        model = tiny_gpt(seed)
        hidden, other = split_params(model)
        return model, [Muon(hidden, **MUON), torch.optim.AdamW(other, **ADAMW)]
    model, opts = build(0)
    (x, y), = micro_batches(*token_batch(0, BATCH, SEQ, VOCAB), rank, world)
    model(x, y)[1].backward()
    for p in model.parameters():  # averaged, so that the replicas stay equal
        dist.all_reduce(p.grad)
        p.grad /= world
    for o in opts:
        o.step()
    saved = [(plain.load, plain.save(f"{folder}/plain", 1, model, opts)),
             (checkpoint.load, checkpoint.save(f"{folder}/full", 1, model, opts))]
    out = [_state(model, opts)]
    for load, path in saved:
        model, opts = build(1)  # other weights, no optimizer state: all of it must come from the file
        load(path, model, opts)
        out.append(_state(model, opts))
    return out


def _ranks(folder: str):
    torch.set_num_threads(1)  # as the one-process oracles: fp32 matmul sums in an order set by threads
    out = {("zero", s, plain): _zero(s, plain) for s in (1, 2, 3) for plain in (True, False)}
    return {**out, **{("muon", plain): _muon(plain) for plain in (True, False)},
            "checkpoint": _checkpoints(folder)}


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _one_process_adamw():
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(STEPS):
        model(*token_batch(step, BATCH, SEQ, VOCAB))[1].backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_plain_zero_muon_and_checkpoint_equal_the_classes_and_one_process(pool, tmp_path):
    results = pool(2).run(_ranks, str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from minidist.muon import Muon
        from test_muon import _run
        adamw, muon = _one_process_adamw(), _run(lambda ps: Muon(ps, **MUON))[0]
    finally:
        torch.set_num_threads(threads)
    for r in results:
        for stage in (1, 2, 3):
            plain, optimised = r["zero", stage, True], r["zero", stage, False]
            for a, b, c in zip(plain, optimised, adamw):
                # the same arithmetic on the same values, the average summed in one order
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"stage {stage}: {m}")
                # against one process: the batch's mean summed in another order, fp32 ulps
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage}: {m}")
        for a, b, c in zip(r["muon", True], r["muon", False], muon):
            assert torch.equal(a, b) and torch.equal(a, c)  # the same operations: the same bits
        original, via_plain, via_full = r["checkpoint"]
        assert _same(via_plain, original) and _same(via_full, original)


def test_plain_newton_schulz_and_muon_equal_minidist_muon_on_one_process():
    from minidist.muon import Muon
    from minidist.muon.orthogonalize import newton_schulz, newton_schulz_many
    from minidist.muon.plain import PlainMuon, newton_schulz as plain_newton_schulz
    from test_muon import _run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fp32 matmul sums in an order set by threads
    try:
        g = torch.Generator().manual_seed(0)
        for shape in ((16, 48), (48, 16), (32, 32)):
            G = torch.randn(*shape, generator=g)
            for dtype in (torch.bfloat16, torch.float32):
                ours = plain_newton_schulz(G, 5, dtype)
                # the products of the batched chain Muon runs, in its layout: the same bits
                assert torch.equal(ours, newton_schulz_many([G], 5, dtype)[0])
                if dtype == torch.bfloat16 or shape[0] <= shape[1]:
                    assert torch.equal(ours, newton_schulz(G, 5, dtype))
                else:  # fp32, tall: newton_schulz multiplies a transposed view, summing in another order
                    torch.testing.assert_close(ours, newton_schulz(G, 5, dtype), rtol=1e-5, atol=1e-6)
        for dtype in (torch.bfloat16, torch.float32):
            kw = {**MUON, "ns_dtype": dtype}
            for a, b in zip(_run(lambda ps: PlainMuon(ps, **kw))[0], _run(lambda ps: Muon(ps, **kw))[0]):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)
