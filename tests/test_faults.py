"""Surviving faults (chapter 08): a rank SIGKILLed mid-run under torchrun --max-restarts
comes back from the last checkpoint and ends exactly where the uninterrupted run ends;
a kill while a checkpoint is being written leaves the previous one whole; and the debug
mode of minidist.checkpoint.faults names the first collective on which ranks diverge, or the rank
that never arrives, within its timeout."""

import json

import pytest
import torch
import torch.distributed as dist

from conftest import run
from minidist import checkpoint
from minidist.checkpoint import faults
from minidist.ddp import DDP
from minidist.launch import LaunchError, launch
from minidist.model import GPT, GPTConfig

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "8",
        "--steps", "6", "--warmup-steps", "2", "--eval-interval", "100", "--log-interval", "1",
        "--final-eval-windows", "2", "--sample-tokens", "2", "--checkpoint-every", "2",
        # ZeRO-2 shards and fp16's loss scale (growing every 2 steps) are state to restore too
        "--zero-stage", "2", "--precision", "fp16", "--loss-scale-growth-interval", "2"]


def _torchrun(out, *extra, restarts=0, fault=None):
    cmd = ["torchrun", "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}",
           "minidist/train_gpt.py", *TINY, "--out-dir", str(out), *extra]
    return run(cmd, timeout=300, env={"MINIDIST_FAULT": fault} if fault else {"MINIDIST_FAULT": ""})


def _job(out, fault=""):
    """train_gpt's main on 2 launched ranks: what torchrun's ranks do, without starting
    torchrun and its workers (torchrun below only where its restart is the point)."""
    import os
    from minidist import train_gpt
    train_gpt.cleanup = lambda: None  # launch ends the group
    os.environ["MINIDIST_FAULT"] = fault
    train_gpt.main([*TINY, "--out-dir", out])


def _final(out):
    state = checkpoint.Reader(checkpoint.latest(out / "checkpoints")).consolidated()
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    return state, losses


def test_killed_rank_and_killed_save_resume_exactly(tmp_path):
    """Three jobs: the uninterrupted run; a run whose rank 1 is killed while writing step
    4's checkpoint (the job fails); and that run started again by hand under torchrun,
    whose rank 1 is killed after step 5 and which torchrun restarts. The last job resumes
    twice (from the killed save's predecessor, then from a checkpoint a resumed run wrote)
    and must end bitwise where the uninterrupted run ends."""
    launch(_job, 2, str(tmp_path / "whole"), timeout_s=300)
    whole, whole_losses = _final(tmp_path / "whole")
    assert len(whole_losses) == 6
    scales = [r["loss_scale"] for r in map(json.loads, (tmp_path / "whole" / "metrics.jsonl")
                                           .read_text().splitlines()) if "loss_scale" in r]
    assert len(set(scales)) > 1  # the scale moved, so resuming it matters

    # rank 1 is SIGKILLed while writing step 4's checkpoint: the job fails
    out = tmp_path / "killed"
    with pytest.raises(LaunchError, match="rank 1 of 2 exited with code -9"):
        launch(_job, 2, str(out), "kill:save:4:1", timeout_s=300)
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_00000002"]
    assert (out / "checkpoints" / ".tmp_step_00000004").is_dir()  # the unfinished one, hidden

    # started again by hand, it resumes from step 2; its rank 1 is SIGKILLed after step 5;
    # torchrun restarts both ranks, which resume from the step 4 this job saved
    r = _torchrun(out, "--resume", "auto", restarts=1, fault="kill:step:5:1")
    assert r.returncode == 0, r.stderr
    assert "injected fault: SIGKILL rank 1 at step 5" in r.stderr
    resumed = [line for line in r.stdout.splitlines() if "resumed from" in line]
    assert len(resumed) == 2 and "at step 2" in resumed[0] and "at step 4" in resumed[1], r.stdout

    state, losses = _final(out)
    assert losses == whole_losses  # the log rows of steps 1-4 came from the checkpoints
    assert state.keys() == whole.keys()
    for k, v in whole.items():  # bitwise: the same arithmetic in the same order
        assert torch.equal(state[k], v) if torch.is_tensor(v) else state[k] == v, k
    assert not (out / "checkpoints" / ".tmp_step_00000004").exists()


def test_resume_refuses_other_settings_before_any_work(tmp_path, capsys):
    from minidist import train_gpt
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    meta = {"format": 1, "step": 2, "world_size": 2, "optimizers": [], "scaler": {},
            "extra": {"settings": {"lr": 0.5, "n_layer": 2}}}
    (out / "checkpoints" / "step_00000002" / "meta.json").write_text(json.dumps(meta))
    for extra, says in ((["--resume", "auto"], "lr: 0.5 saved"), ([], "--resume auto continues it")):
        with pytest.raises(SystemExit) as e:  # train_gpt's main, in this process: the same checks
            train_gpt.main([*TINY, "--out-dir", str(out), *extra])
        assert e.value.code == 2 and says in capsys.readouterr().err


def _diverge(how, timeout_s):
    """2 ranks under the collective tracer, a training loop shaped like train_gpt's; rank 1
    skips the backward of step 1 ("skip"), or stops there ("stop"). The tracer waits
    `timeout_s` for a peer at each collective: a mismatch is found without waiting, so
    "skip" gets a long one; "stop" waits it out once, and its earlier collectives, a few
    milliseconds of work apart, need a margin of only a second or two."""
    faults.trace_collectives(timeout_s=timeout_s)
    try:
        torch.manual_seed(0)
        model = DDP(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)))
        x = torch.randint(0, 32, (2, 9))
        for step in range(3):
            if (dist.get_rank(), step, how) == (1, 1, "stop"):
                return "stopped"
            dist.all_reduce(torch.ones(1, dtype=torch.float64))  # the batch's token count
            loss = model(x[:, :-1], x[:, 1:])[1]
            if (dist.get_rank(), step) != (1, 1):
                loss.backward()  # DDP all-reduces the gradients' buckets
            dist.all_reduce(loss.detach())  # the logged loss
            model.module.zero_grad()
    finally:
        faults.stop_tracing()


def test_mismatch_detector_names_the_first_divergent_collective():
    with pytest.raises(faults.CollectiveMismatch) as e:
        launch(_diverge, 2, "skip", 30, timeout_s=60)
    text = str(e.value)
    assert "ranks diverge at collective #" in text, text
    assert "all_reduce(float32[" in text and "ddp.py" in text  # the gradients' bucket, on rank 0
    assert "all_reduce(float32[])" in text and "test_faults.py" in text  # the loss, on rank 1


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    with pytest.raises(faults.CollectiveMismatch) as e:
        launch(_diverge, 2, "stop", 2, timeout_s=60)
    text = str(e.value)
    assert "rank 1 did not reach collective #" in text and "within 2 s" in text, text
    assert "Rank 1's last collective was #" in text
