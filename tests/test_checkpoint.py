"""Checkpoints (minidist.checkpoint): what is saved equals what the run held, whatever the
world size and ZeRO stage that saved it, and a run resumed on another world size or
stage continues as the uninterrupted one does. The oracle is one process with plain
AdamW (and Muon) on the same batches: ZeRO and distributed Muon equal it (tests/test_zero.py,
tests/test_muon.py), so each rank's pieces, put together, must equal its state."""

import pytest
import torch
import torch.distributed as dist

from minidist import checkpoint
from minidist.ddp import allreduce_gradients_flat
from minidist.launch import launch
from minidist.model import GPT, GPTConfig
from minidist.compose.build import make_optimizers
from minidist.train import forward_backward

CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0)
BATCH = 12  # sequences per global batch: divisible by 1, 2, 3 and 4 ranks


def _opts(stage, optimizer):  # make_optimizers' keywords
    return dict(optimizer=optimizer, weight_decay=0.1, lr=1e-2, zero_stage=stage, bucket_cap_mb=0.01,
                muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.01)


def _batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"] + 1), generator=g)
    part = x[rank * BATCH // world:(rank + 1) * BATCH // world]
    return part[:, :-1], part[:, 1:]


def _run(stage, optimizer, first, last, load_from=None, save_to=None):
    """Steps [first, last) of a tiny GPT; load before, save after. Returns, from rank 0,
    the full parameters and what the saved checkpoint consolidates to."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    opts = make_optimizers(model, **_opts(stage, optimizer))
    for g in (g for o in opts for g in o.param_groups if "eps" in g):
        # the key projection's bias has an exactly zero gradient (softmax ignores a shift
        # shared by all keys), so what arrives is rounding noise, which Adam with eps 1e-8
        # blows up to +-lr differently for each summation order: eps 1e-4 keeps it noise
        g["eps"] = 1e-4
    for o in opts:  # Muon: fp32 Newton-Schulz, which does not round away the gradients' last bits
        o.ns_dtype = torch.float32
    zero = opts[0] if stage else None
    if load_from:
        meta = checkpoint.load(load_from, model, opts)
        assert meta["step"] == first
    for step in range(first, last):
        forward_backward(model, [_batch(step, rank, world)], world, zero)
        if zero is None and world > 1:
            allreduce_gradients_flat(model)
        for o in opts:
            o.step()
            o.zero_grad()
    out = {}
    if save_to:
        checkpoint.save(save_to, last, model, opts)
        out["saved"] = checkpoint.Reader(save_to + f"/step_{last:08d}").consolidated() if rank == 0 else None
    ctx = zero.gathered() if stage == 3 else torch.no_grad()
    with ctx:
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_reshard_between_world_sizes_and_stages(tmp_path, optimizer, pool):
    # the five runs take their ranks from the session's pools (tests/conftest.py)
    d = str(tmp_path)
    stages = (2, 3, 0) if optimizer == "adamw" else (0, 0, 0)
    # the oracle: one process, 4 steps, saving after 2
    one2 = pool(1).run(_run, 0, optimizer, 0, 2, None, d + "/one")[0]
    one4 = pool(1).run(_run, 0, optimizer, 2, 4, d + "/one/step_00000002", None)[0]
    # 4 ranks (ZeRO-2 or Muon spread over 4) save; 2 ranks (ZeRO-3 / Muon over 2) resume;
    # then 3 ranks at stage 0 resume that
    a = pool(4).run(_run, stages[0], optimizer, 0, 2, None, d + "/a")[0]
    pool(2).run(_run, stages[1], optimizer, 2, 3, d + "/a/step_00000002", d + "/b")
    c = pool(3).run(_run, stages[2], optimizer, 3, 4, d + "/b/step_00000003", None)[0]
    saved = a["saved"]
    for name, p in a["params"].items():  # the checkpoint holds exactly what the run held
        assert torch.equal(saved[f"model/{name}"], p), name
    reference = one2["saved"]
    assert saved.keys() == reference.keys()
    assert any(k.endswith("/exp_avg_sq") for k in saved)
    if optimizer == "muon":
        assert any(k.endswith("/momentum_buffer") for k in saved)
    for k, v in reference.items():  # optimizer state: equal to one process's, up to summation order
        torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    for name, p in one4["params"].items():  # and the resumed run continues as one process does
        torch.testing.assert_close(c["params"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _buffers_and_a_failed_write(root):
    """A model with a persistent buffer round-trips; a NaN that only rank 1 would write
    stops the save on both ranks; then rank 1's write fails."""
    torch.manual_seed(dist.get_rank())  # different on each rank: only rank i mod N's copy is saved
    model = torch.nn.Linear(3, 2)
    model.register_buffer("count", torch.arange(4.0) + 10)
    checkpoint.save(root, 1, model, [])
    # rank 1 writes the bias (the weight, larger, goes to rank 0): NaN there, on rank 1 only
    with torch.no_grad():
        saved_bias = model.bias.clone()
        if dist.get_rank() == 1:
            model.bias[0] = float("nan")
    try:
        checkpoint.save(root, 3, model, [])
        non_finite = None
    except checkpoint.NonFiniteCheckpointError as e:
        non_finite = e.what
    with torch.no_grad():
        model.bias.copy_(saved_bias)
    fresh = torch.nn.Linear(3, 2)
    fresh.register_buffer("count", torch.zeros(4))
    checkpoint.load(root + "/step_00000001", fresh, [])
    ok = torch.equal(fresh.count, torch.arange(4.0) + 10)
    same = [torch.zeros(2, 3) for _ in range(2)]
    dist.all_gather(same, fresh.weight.detach().contiguous())
    if dist.get_rank() == 1:  # the disk fills up on rank 1
        def full(*a, **k):
            raise OSError(28, "No space left on device")
        torch.save = full
    try:
        checkpoint.save(root, 2, model, [])
    except RuntimeError as e:
        return ok, torch.equal(same[0], same[1]), str(e), non_finite
    return ok, torch.equal(same[0], same[1]), None, non_finite


def test_buffers_are_saved_and_a_failed_write_fails_every_rank(tmp_path):
    results = launch(_buffers_and_a_failed_write, 2, str(tmp_path), timeout_s=60)
    for ok, same, error, non_finite in results:  # every rank, not just the one whose disk filled up
        assert ok and same
        assert error and "step_00000002 was not saved (rank 1" in error, error
        assert non_finite == ["model"]  # rank 0 too, though its own copy of the bias is finite
    assert "(rank 1: [Errno 28] No space left on device; free space in" in results[1][2]  # and why, where it happened
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001"]
    # each rank's file is bound to its rank: the two files swapped are damage, named
    one = tmp_path / "step_00000001"
    assert checkpoint.verify(one) == []
    a, b = one / "shard_00000_of_00002.pt", one / "shard_00001_of_00002.pt"
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    assert "shard_00000_of_00002.pt: holds rank 1's shard, under rank 0's name" in checkpoint.verify(one)[0]
