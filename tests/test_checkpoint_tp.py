"""Checkpoints of tensor- and pipeline-parallel runs (minidist.checkpoint,
minidist.checkpoint.slots): saved by full name and flat element range, so a --tp 2
checkpoint resumes at --tp 1 (one process) and a --tp 1 one at --tp 2, at ZeRO stages 0, 1
and 2 over the dp axis; a tp 2 x pp 2 one (each stage holding its own blocks, the first and
the last the tied embedding) on one process, and a one-process one at dp 2 x pp 2, ZeRO-1.

The oracle is one process, tp 1, plain AdamW, on the same global batches, run once without
interruption: every checkpoint, consolidated, equals its state at the same step, and every
resumed run continues as it does. Tolerance, fp32: rtol 1e-5, atol 1e-6 (the arithmetic is
the same, grouped differently: matmuls over slices summed by all-reduces; eps 1e-4 as in
tests/test_checkpoint.py, for the key bias whose gradient is rounding noise). What each
run saved must hold its own shards exactly (torch.equal).
"""

import shutil

import pytest
import torch
import torch.distributed as dist

from minidist import checkpoint
from minidist.checkpoint.slots import cut_runs, flat_runs
from minidist.compose.mesh import make_mesh
from minidist.model import GPT, GPTConfig
from minidist.pipeline import Stage
from minidist.tensor_parallel import shard_of
from minidist.tensor_parallel.gpt import parallelize
from minidist.compose.build import gradient_sync, make_optimizers, make_step
from minidist.train import forward_backward

# 61 tokens: vocabulary rows 31 / 30 at tp 2, so ZeRO cuts each tp rank's flat buffer at other
# places, and the replicated tensors' state must still be written exactly once
CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61, dropout=0.0)
BATCH = 8  # sequences per global batch: divisible by dp 1 and 2
TOL = dict(rtol=1e-5, atol=1e-6)


OPTS = dict(optimizer="adamw", weight_decay=0.1, lr=1e-2, bucket_cap_mb=0.01)  # make_optimizers' keywords


def _batch(step, dp_rank, dp):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"] + 1), generator=g)
    part = x[dp_rank * BATCH // dp:(dp_rank + 1) * BATCH // dp]
    return part[:, :-1], part[:, 1:]


def _run(tp, stage, first, last, load_from=None, root=None, save_at=(), pp=1):
    """Steps [first, last) at dp x tp x pp (dp = world / (tp pp)), ZeRO `stage` over dp; a
    pipeline runs each batch as two micro-batches (1F1B); load before, save after each step
    in `save_at`. Returns the losses and, from rank 0, what each saved checkpoint
    consolidates to; every rank checks its own shards against what it saved."""
    rank = dist.get_rank()
    mesh = make_mesh(tp=tp, pp=pp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    if tp > 1:
        model = parallelize(model, mesh.tp_group)
    if pp > 1:
        model = Stage(model, mesh.pp_group)
    opts = make_optimizers(model, zero_stage=stage, group=mesh.dp_group, **OPTS)
    for g in (g for o in opts for g in o.param_groups):
        g["eps"] = 1e-4
    sync = gradient_sync(model, opts, zero_stage=stage, bucket_cap_mb=0.01, mesh=mesh)
    if load_from:
        assert checkpoint.load(load_from, model, opts)["step"] == first
    out = {"losses": [], "saved": {}}
    for step in range(first, last):
        x, y = _batch(step, mesh.dp_rank, mesh.dp)
        if pp > 1:
            h = len(x) // 2
            pipeline = make_step(model, sync, None, "fp32", mesh.dp, mesh.dp_group, "1f1b", mesh)
            out["losses"].append(pipeline.forward_backward([(x[:h], y[:h]), (x[h:], y[h:])]))
        else:
            out["losses"].append(forward_backward(model, [(x, y)], mesh.dp, sync, None, "fp32", mesh.dp_group))
        for o in opts:
            o.step()
            o.zero_grad()
        if step + 1 in save_at:
            path = checkpoint.save(root, step + 1, model, opts, keep=0)
            r = checkpoint.Reader(path)
            for n, p in model.named_parameters():  # the checkpoint holds exactly what this rank held
                shape = r.shapes[f"model/{n}"]
                full = r.read(f"model/{n}", 0, torch.Size(shape).numel()).view(shape)
                assert torch.equal(shard_of(full, getattr(p, "tp_shard", None)), p.detach()), n
            out["saved"][step + 1] = r.consolidated() if rank == 0 else None
    return out


def _close(got: dict, want: dict):
    assert got.keys() == want.keys()
    assert any(k.endswith("/exp_avg_sq") for k in want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def oracle(pool, tmp_path_factory):
    """One process, tp 1, steps 0..4 uninterrupted, saving after steps 2 and 4."""
    root = tmp_path_factory.mktemp("oracle")
    return {**pool(1).run(_run, 1, 0, 0, 4, None, str(root), (2, 4))[0], "root": root}


def test_runs_map_a_shard_to_the_full_tensor():
    """flat_runs and cut_runs put every element of a shard (and of any range of it) where
    it sits in the full tensor: rows along dim 0, one run per row along dim 1."""
    full = torch.arange(6 * 10 * 3).view(6, 10, 3)
    for spec in [None, (0, ((2, 5),)), (0, ((0, 1), (3, 4), (5, 6))), (1, ((4, 7),)), (2, ((1, 3),)),
                 (1, ((0, 2), (5, 6)))]:
        shard, runs = shard_of(full, spec).reshape(-1), flat_runs(tuple(full.shape), spec)
        for lo, hi in [(0, shard.numel()), (1, shard.numel() - 2), (7, 8), (4, 4)]:
            got = torch.full((hi - lo,), -1)
            for o, s, n in cut_runs(runs, lo, hi):
                got[o:o + n] = full.view(-1)[s:s + n]
            assert torch.equal(got, shard[lo:hi]), (spec, lo, hi)
    assert len(flat_runs((6, 10, 3), (1, ((4, 7),)))) == 6  # rows, not elements
    assert len(flat_runs((6, 10, 3), (0, ((2, 5),)))) == 1


def test_tp2_checkpoint_resumes_on_one_process(oracle, pool, tmp_path):
    a = pool(2).run(_run, 2, 0, 0, 2, None, str(tmp_path / "a"), (2,))[0]
    assert a["losses"] == pytest.approx(oracle["losses"][:2], rel=1e-5, abs=1e-6)
    _close(a["saved"][2], oracle["saved"][2])
    path = tmp_path / "a" / "step_00000002"
    r = checkpoint.Reader(path)
    C = CFG["n_embd"]  # split by columns: a piece per row of each rank's slice
    assert len(r.pieces["model/blocks.0.mlp.c_proj.weight"]) == 2 * C
    assert len(r.pieces["model/blocks.0.attn.c_attn.weight"]) == 2 * 3  # q, k, v rows of each rank
    b = pool(1).run(_run, 1, 0, 2, 4, str(path), str(tmp_path / "b"), (4,))[0]
    assert b["losses"] == pytest.approx(oracle["losses"][2:], rel=1e-5, abs=1e-6)
    _close(b["saved"][4], oracle["saved"][4])


def test_tp1_zero1_checkpoint_resumes_at_tp2(oracle, pool, tmp_path):
    c = pool(2).run(_run, 1, 1, 0, 2, None, str(tmp_path / "c"), (2,))[0]  # dp 2, ZeRO-1
    _close(c["saved"][2], oracle["saved"][2])
    d = pool(2).run(_run, 2, 1, 2, 4, str(tmp_path / "c" / "step_00000002"), str(tmp_path / "d"), (4,))[0]
    assert d["losses"] == pytest.approx(oracle["losses"][2:], rel=1e-5, abs=1e-6)
    _close(d["saved"][4], oracle["saved"][4])


def test_dp2_tp2_zero2_checkpoint_resumes_at_tp2_on_two_ranks(oracle, pool, tmp_path):
    e = pool(4).run(_run, 2, 2, 0, 2, None, str(tmp_path / "e"), (2,))[0]  # dp 2 x tp 2, ZeRO-2
    assert e["losses"] == pytest.approx(oracle["losses"][:2], rel=1e-5, abs=1e-6)
    _close(e["saved"][2], oracle["saved"][2])
    f = pool(2).run(_run, 2, 0, 2, 4, str(tmp_path / "e" / "step_00000002"), str(tmp_path / "f"), (3, 4))[0]
    assert f["losses"] == pytest.approx(oracle["losses"][2:], rel=1e-5, abs=1e-6)
    _close(f["saved"][4], oracle["saved"][4])
    # format 3's seal: a tp shard file copied from another checkpoint of the same run is damage
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "f" / "step_00000004", mixed / "step_00000004")
    shutil.copy(tmp_path / "f" / "step_00000003" / "shard_00001_of_00002.pt",
                mixed / "step_00000004" / "shard_00001_of_00002.pt")
    with pytest.raises(checkpoint.CheckpointError, match="belongs to another checkpoint"):
        checkpoint.Reader(mixed / "step_00000004")
    assert checkpoint.verify(mixed / "step_00000004")
    assert checkpoint.verify(tmp_path / "f" / "step_00000004") == []


def test_tp2_pp2_checkpoint_resumes_on_one_process(oracle, pool, tmp_path):
    g = pool(4).run(_run, 2, 0, 0, 2, None, str(tmp_path / "g"), (2,), 2)[0]  # tp 2 x pp 2
    assert g["losses"] == pytest.approx(oracle["losses"][:2], rel=1e-5, abs=1e-6)
    _close(g["saved"][2], oracle["saved"][2])  # each tensor once: the tied one from one stage
    h = pool(1).run(_run, 1, 0, 2, 4, str(tmp_path / "g" / "step_00000002"), str(tmp_path / "h"), (4,))[0]
    assert h["losses"] == pytest.approx(oracle["losses"][2:], rel=1e-5, abs=1e-6)
    _close(h["saved"][4], oracle["saved"][4])


def test_one_process_checkpoint_resumes_at_dp2_pp2_zero1(oracle, pool, tmp_path):
    i = pool(4).run(_run, 1, 1, 2, 4, str(oracle["root"] / "step_00000002"), str(tmp_path / "i"), (4,), 2)[0]
    assert i["losses"] == pytest.approx(oracle["losses"][2:], rel=1e-5, abs=1e-6)
    _close(i["saved"][4], oracle["saved"][4])


@pytest.mark.parametrize("split", [["--tp", "2"], ["--pp", "2", "--grad-accum-steps", "2"]])
def test_train_gpt_resumes_a_tp2_or_pp2_checkpoint_on_one_process(pool, tmp_path, split):
    """--tp 2 (or --pp 2) on 2 ranks saves after steps 2 and 4; one process resumes from
    step 2 and logs the same losses for steps 3 and 4, and the same validation loss."""
    from minidist import train_gpt
    argv = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--tokenizer",
            "gpt2-512", "--lr", "3e-3", "--warmup-steps", "1", "--eval-windows", "4",
            "--final-eval-windows", "8", "--sample-tokens", "2", "--log-interval", "1", "--device", "cpu",
            "--optimizer", "adamw", "--steps", "4", "--batch-size", "4", "--eval-interval", "100"]
    tp2 = pool(2).run(train_gpt.main, argv + split + ["--checkpoint-every", "2",
                                                      "--out-dir", str(tmp_path / "tp2")])[0]
    step2 = tmp_path / "tp2" / "checkpoints" / "step_00000002"
    tp1 = pool(1).run(train_gpt.main, argv + ["--resume", str(step2), "--out-dir", str(tmp_path / "tp1")])[0]
    losses = lambda s: {r["step"]: r["loss"] for r in s["rows"] if "loss" in r}
    assert losses(tp1) == pytest.approx(losses(tp2), rel=1e-5, abs=1e-6)
    assert tp1["val_loss"] == pytest.approx(tp2["val_loss"], rel=1e-5)
