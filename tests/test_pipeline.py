"""Chapter 11: minidist.pipeline against its oracle and its formulas. At pp 2, 3 (4 blocks
cut 2/1/1) and 4, with 1, 2, 4 and 8 micro-batches, GPipe and 1F1B each give every stage
the gradients of one process's gradient accumulation over the same micro-batches (the
tied embedding/head matrix's on the first and the last stage), and the same loss on every
stage; each stage ran its schedule's order of forwards and backwards, held as many
micro-batches in flight as the formula says, and saved for backward exactly the bytes
chapter 09's count predicts, per micro-batch and at the peak. The bubble is checked on a
made-up timeline only: measured times are not asserted (they depend on the machine).

One pool call per world size runs every case (pp 3 runs on three of the four ranks of the
pp 4 call); the one-process oracle runs here, once per micro-batch count.

Tolerance, fp32: rtol 1e-5, atol 1e-6 (gradients of a loss normalised per token, values
of order 1e-4..1). A stage runs the same operations on the same numbers as the full model;
what differs is the order in which gradients are summed: the tied matrix's (lookup and
head halves summed per stage, then added across stages) and accumulation across
micro-batches. That is fp32 rounding (eps 1.2e-7), a few ulps; a missing or doubled
micro-batch, or a missing half of the tied gradient, is off by O(1) of the value.
"""

import pytest
import torch
import torch.distributed as dist

from helpers import accumulated
from minidist import pipeline as pl
from minidist.pipeline import measure as pm
from minidist.compose.mesh import make_mesh
from minidist.model import GPT, GPTConfig

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = dict(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=64)
B, T = 2, 16  # one micro-batch
MS = (1, 2, 4, 8)
CASES = [(m, sched) for m in MS for sched in ("gpipe", "1f1b")]


def _full() -> GPT:
    torch.manual_seed(0)  # the same weights in every process
    model = GPT(GPTConfig(**CFG))
    with torch.no_grad():  # biases start at 0 and gains at 1: a bias or gain lost in a
        for p in model.parameters():  # copy would not show; perturbed, it does
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _micro_batches(m: int):
    """m micro-batches of B sequences, each its own tensor (not a view of one batch: the
    memory count dedups by storage); masked targets, so they hold different token counts."""
    g = torch.Generator().manual_seed(100 + m)
    out = []
    for i in range(m):
        x = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
        y = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
        y[0, T - 1 - i:] = -1
        out.append((x, y))
    return out


def _stage_runs(pp_group):
    """Every case on this rank's stage: (loss, {name: grad}, record)."""
    stage = pl.Stage(_full(), pp_group)
    out = {"names": [n for n, _ in stage.named_parameters()], "layers": list(stage.layers),
           "describe": stage.describe()}
    for m, sched in CASES:
        stage.zero_grad(set_to_none=True)
        rec = pm.StepRecord()
        loss = pl.pipeline_step(stage, _micro_batches(m), sched, record=rec)
        grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
        out[m, sched] = (loss, grads, rec)
    return out


def _on_ranks(world: int):
    out = {world: _stage_runs(make_mesh(pp=world).pp_group)}
    if world == 4:  # pp 3, 4 blocks cut 2/1/1, on ranks 0-2; rank 3 sits it out
        three = dist.new_group([0, 1, 2])  # every rank makes every group
        if dist.get_rank() < 3:
            out[3] = _stage_runs(three)
    return out


@pytest.fixture(scope="module")
def ranks(pool):
    """{pp: [what stage s returned]}: one pool call per world size."""
    two = pool(2).run(_on_ranks, 2)
    four = pool(4).run(_on_ranks, 4)
    return {2: [r[2] for r in two], 3: [r[3] for r in four[:3]], 4: [r[4] for r in four]}


@pytest.fixture(scope="module")
def oracle():
    """{m: (loss, {name: grad})}: one process accumulating over the m micro-batches, the
    loss normalised by the target count of all of them (minidist.train.forward_backward)."""
    return {m: accumulated(_full(), _micro_batches(m)) for m in MS}


# ---------------------------------------------------------------- the cut

def test_the_cut_balances_contiguous_blocks():
    assert pl.split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert pl.split_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert pl.split_layers(12, 5) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10), range(10, 12)]
    assert pl.describe_cut(4, 2) == "stage 0: embeddings + blocks 0-1 | stage 1: blocks 2-3 + ln_f + head"
    assert pl.describe_cut(4, 1) == "stage 0: embeddings + blocks 0-3 + ln_f + head"
    with pytest.raises(ValueError, match="--pp 5 needs 1 to n_layer=4"):
        pl.split_layers(4, 5)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_stages_hold_the_full_models_parameters_by_name(ranks, p):
    full = {n for n, _ in _full().named_parameters()}
    names = [set(r["names"]) for r in ranks[p]]
    assert set().union(*names) == full
    # every parameter on one stage, except the tied matrix, on the first and the last
    for n in full:
        holders = [s for s in range(p) if n in names[s]]
        assert holders == ([0, p - 1] if n == "wte.weight" else holders[:1]), n
    assert [r["layers"] for r in ranks[p]] == [list(rg) for rg in pl.split_layers(4, p)]
    assert all(r["describe"] == pl.describe_cut(4, p) for r in ranks[p])


# ---------------------------------------------------------------- equal to one process

@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m, sched", CASES)
def test_gradients_and_loss_equal_one_process(ranks, oracle, p, m, sched):
    ref_loss, ref_grads = oracle[m]
    losses = [r[m, sched][0] for r in ranks[p]]
    assert all(lo == losses[0] for lo in losses)  # the same number on every stage
    assert losses[0] == pytest.approx(ref_loss, rel=1e-6)
    for s, r in enumerate(ranks[p]):
        for name, grad in r[m, sched][1].items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda e: f"stage {s} {name}: {e}")
    # the tied matrix: the first and the last stage hold the same summed gradient
    assert torch.equal(ranks[p][0][m, sched][1]["wte.weight"], ranks[p][-1][m, sched][1]["wte.weight"])


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="gpipe, 1f1b"):
        pl.pipeline_step(None, [], "interleaved")


# ---------------------------------------------------------------- the schedules' order

def _expected_order(sched: str, p: int, s: int, m: int):
    """Written out independently of minidist.pipeline: GPipe, all F then all B; 1F1B,
    min(p - s - 1, m) forwards, then F and B alternating, then the backwards left."""
    F = [("F", i) for i in range(m)]
    Bk = [("B", i) for i in range(m)]
    if sched == "gpipe":
        return F + Bk
    w = min(p - s - 1, m)
    order = F[:w]
    for j in range(m - w):
        order += [F[w + j], Bk[j]]
    return order + Bk[m - w:]


def test_the_1f1b_order_written_out():
    # p 4, m 8: the first stage warms up with 3, the last alternates from the start
    f, b = "F", "B"
    assert _expected_order("1f1b", 4, 0, 8) == [(f, 0), (f, 1), (f, 2), (f, 3), (b, 0), (f, 4), (b, 1), (f, 5),
                                                (b, 2), (f, 6), (b, 3), (f, 7), (b, 4), (b, 5), (b, 6), (b, 7)]
    assert _expected_order("1f1b", 4, 3, 3) == [(f, 0), (b, 0), (f, 1), (b, 1), (f, 2), (b, 2)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_each_stage_ran_its_schedules_order(ranks, p):
    for s, r in enumerate(ranks[p]):
        for m, sched in CASES:
            assert r[m, sched][2].order() == _expected_order(sched, p, s, m), (s, m, sched)


# ---------------------------------------------------------------- memory in flight

@pytest.mark.parametrize("p", [2, 3, 4])
def test_in_flight_activations_equal_the_formula(ranks, p):
    cfg = GPTConfig(**CFG)
    cut = pl.split_layers(4, p)
    for s, r in enumerate(ranks[p]):
        per_mb = pm.stage_activation_bytes(cfg, B, T, len(cut[s]), s == 0, s == p - 1)
        for m, sched in CASES:
            rec = r[m, sched][2]
            k = pm.in_flight_formula(sched, p, s, m)
            assert rec.saved_bytes == [per_mb] * m, (s, m, sched)  # counted == derived
            assert rec.peak_in_flight == k == pm.in_flight(rec.order()), (s, m, sched)
            assert rec.peak_saved == k * per_mb, (s, m, sched)
        # GPipe holds all m; 1F1B at most p - s, so p on the first stage
        assert r[8, "gpipe"][2].peak_in_flight == 8
        assert r[8, "1f1b"][2].peak_in_flight == p - s


def test_stage_bytes_add_up_to_chapter_09s_count():
    # cut anywhere, the stages' bytes per micro-batch sum to the whole model's
    from minidist.memory import count_saved_bytes
    model, (x, y) = _full(), _micro_batches(1)[0]
    whole = count_saved_bytes(model, x.clone(), y.clone())["total"]
    cfg = GPTConfig(**CFG)
    for p in (1, 2, 3, 4):
        cut = pl.split_layers(4, p)
        assert sum(pm.stage_activation_bytes(cfg, B, T, len(c), s == 0, s == p - 1)
                   for s, c in enumerate(cut)) == whole


# ---------------------------------------------------------------- the timeline and the bubble

@pytest.mark.parametrize("p", [2, 4])
def test_timelines_are_well_formed(ranks, p):
    # facts about the recording, not about the machine's speed
    recs = [r[8, "1f1b"][2] for r in ranks[p]]
    for s, rec in enumerate(recs):
        assert (rec.stage, rec.stages) == (s, p)
        ev = rec.events
        assert all(0 <= e.start <= e.end for e in ev)
        assert all(a.end <= b.start for a, b in zip(ev, ev[1:]))  # one thing at a time, in order
        assert {e.kind for e in ev} == {"F", "B", "send", "recv", "send+recv"}
        # GPipe's messages go one at a time; 1F1B pairs the two that cross on a link
        assert "send+recv" not in {e.kind for e in ranks[p][s][8, "gpipe"][2].events}
    filled = pm.with_idle(recs)
    end = max(e.end for r in recs for e in r.events)
    for events in filled:  # idle fills every gap: the stage's time is accounted for
        assert events[0].start == 0 and events[-1].end == end
        assert all(a.end == b.start for a, b in zip(events, events[1:]))
    assert 0 <= pm.bubble_fraction(recs) < 1
    assert len(pm.draw(recs).splitlines()) == p


def _made_up(p, m, order_of, tf=1.0, tb=2.0):
    """The ideal timeline of a schedule: each F takes tf and each B tb, messages cost
    nothing, and a step starts as soon as its inputs exist (F i on stage s after F i on
    s - 1, B i on s after B i on s + 1) and the stage is free."""
    done, free, recs = {}, [0.0] * p, [pm.StepRecord(stage=s, stages=p) for s in range(p)]
    queues = [list(order_of(p, s, m)) for s in range(p)]
    while any(queues):
        left = sum(map(len, queues))
        for s in range(p):
            while queues[s]:
                kind, i = queues[s][0]
                dep = (kind, i, s - 1) if kind == "F" else (kind, i, s + 1)
                if 0 <= dep[2] < p and dep not in done:
                    break  # waits on a neighbour
                if kind == "B" and s == p - 1:
                    dep = ("F", i, s)  # the last stage turns its own forward around
                start = max(free[s], done.get(dep, 0.0))
                free[s] = done[kind, i, s] = start + (tf if kind == "F" else tb)
                recs[s].events.append(pm.Event(kind, i, start, free[s]))
                queues[s].pop(0)
        assert sum(map(len, queues)) < left, "the schedule deadlocks"
    return recs


@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_bubble_fraction_of_an_ideal_timeline_is_the_formula(sched, p, m):
    recs = _made_up(p, m, lambda p, s, m: _expected_order(sched, p, s, m))
    assert pm.bubble_fraction(recs) == pytest.approx(pm.bubble_formula(p, m))
    if sched == "gpipe":  # held in flight: m on every stage
        assert [pm.in_flight(r.order()) for r in recs] == [m] * p
    else:
        assert [pm.in_flight(r.order()) for r in recs] == [min(p - s, m) for s in range(p)]


def test_bubble_formula():
    assert pm.bubble_formula(1, 5) == 0
    assert pm.bubble_formula(4, 1) == 0.75  # one micro-batch: one stage busy at a time
    assert pm.bubble_formula(2, 2) == pytest.approx(1 / 3)


def test_the_timeline_waits_for_the_gpu_and_only_there(monkeypatch):
    """A CUDA call returns when its work is queued: the stamp synchronises that device first;
    on a CPU the call has done its work, and the stamp does not wait."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    pm.stamp(torch.device("cpu"))
    pm.stamp(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]
