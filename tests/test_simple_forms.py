"""The plain forms the library opens with equal its optimised classes and one process:
minidist.zero.simple's zero1_step, zero2_step and zero3_step against ShardedOptimizer
(stages 1, 2) and FullyShardedOptimizer and one process's AdamW; Muon.step_round_by_round
(one all-gather per round) against Muon.step (bucketed, overlapped) and one process's Muon.
One call of the session's 2-rank pool runs every case (tests/conftest.py)."""

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
    from test_muon import _run

    class RoundByRound(Muon):
        step = lambda self: self.step_round_by_round()

    return _run(lambda ps: (RoundByRound if plain else Muon)(ps, **MUON))[0]


def _ranks():
    torch.set_num_threads(1)  # as the one-process oracles: fp32 matmul sums in an order set by threads
    out = {("zero", s, plain): _zero(s, plain) for s in (1, 2, 3) for plain in (True, False)}
    return {**out, **{("muon", plain): _muon(plain) for plain in (True, False)}}


def _one_process_adamw():
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(STEPS):
        model(*token_batch(step, BATCH, SEQ, VOCAB))[1].backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_plain_zero_and_muon_steps_equal_the_classes_and_one_process(pool):
    results = pool(2).run(_ranks)
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
