"""Chapter 11's appendix: interleaved 1F1B and ZB-H1 (minidist/pipeline/orders.py, slots.py,
interleaved.py, split.py) against their oracles and their formulas.

Equal to one process: at pp 2 and 4, interleaved 1F1B with v = 2 chunks per stage (8 blocks cut
into 8 chunks at pp 4) and ZB-H1, over several micro-batch counts, give every stage the
gradients of one process's accumulation over the same micro-batches, and the same loss on
every stage. Equal to torch: on the same stages torch's ScheduleInterleaved1F1B and (with one
chunk per stage, where it is ZB-H1) ScheduleInterleavedZeroBubble, both run here on gloo,
order the steps exactly as ours and give the same gradients, to the bit. torch's ScheduleZBVZeroBubble
also runs on gloo, but on a V placement (rank r holds vstages r and 2p - 1 - r): not ZB-H1's
stages, so there is nothing of ours to hold beside it. Each stage held as many (chunk,
micro-batch) forwards in flight as the formula says, with exactly chapter 09's bytes.

Without processes: every link's messages replayed under the strictest rule (a batch ends only
when its peers post the matching batch; messages on a link match in order) never deadlock or
cross; the ideal timeline's idle time equals the closed forms exactly (fractions), for F, B, W
of several sizes. One pool call per world size runs every case; the oracle runs here, once
per micro-batch count. Tolerance and its reason: tests/test_pipeline.py's (fp32, rtol 1e-5,
atol 1e-6: only the order of summation differs; a lost micro-batch or chunk is off by O(1)).
"""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import accumulated
from minidist import pipeline as pl
from minidist.pipeline import measure as pm
from minidist.pipeline import orders
from minidist.model import GPT, GPTConfig

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = dict(n_layer=8, n_head=4, n_embd=32, block_size=16, vocab_size=64)
B, T, V = 2, 16, 2  # a micro-batch; V chunks per stage for interleaved
CASES = {2: [("interleaved", 2), ("interleaved", 4), ("interleaved", 6), ("zb-h1", 1), ("zb-h1", 3), ("zb-h1", 4)],
         4: [("interleaved", 4), ("interleaved", 8), ("zb-h1", 2), ("zb-h1", 4), ("zb-h1", 8)]}
TORCH = {("interleaved", 2): 4, ("interleaved", 4): 8, ("zb-h1", 2): 4, ("zb-h1", 4): 8}  # m of each comparison


def _full() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    with torch.no_grad():  # gains and biases off 1 and 0, so one lost in a copy shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _micro_batches(m: int):
    g = torch.Generator().manual_seed(200 + m)
    out = []
    for i in range(m):
        x = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
        y = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
        y[0, T - 1 - i:] = -1  # masked targets: micro-batches of different token counts
        out.append((x, y))
    return out


class _TorchChunk(nn.Module):
    """One chunk of an InterleavedStage as torch's PipelineStage takes it: tokens or an
    activation in, an activation or the logits out; only the chunk's own layers registered."""

    def __init__(self, stage, chunk: int):
        super().__init__()
        self.vs = chunk * stage.stages + stage.stage
        self.first, self.last = self.vs == 0, self.vs == stage.stages * stage.virtual_stages - 1
        self.blocks = nn.ModuleList(stage.blocks[str(i)] for i in stage.chunks[chunk])
        self.ends = nn.ModuleList(([stage.wte, stage.wpe] if self.first else []) +
                                  ([stage.ln_f, stage.lm_head] if self.last else []))
        self._stage = [stage]  # (not a submodule: its other chunks are not this one's)

    def forward(self, x):
        s = self._stage[0]
        x = s.embed(x) if self.first else x
        for block in self.blocks:
            x = block(x)
        return s.head(x)[0] if self.last else x


def _torch_schedule(kind, stage, m):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
    p, v = stage.stages, stage.virtual_stages
    chunks = [PipelineStage(_TorchChunk(stage, c), c * p + stage.stage, p * v, torch.device("cpu")) for c in range(v)]
    count = float(sum(int((y != -1).sum()) for _, y in _micro_batches(m)))

    def loss_fn(logits, target):  # normalised as run_schedule normalises its loss
        return F.cross_entropy(logits.float().flatten(0, 1), target.reshape(-1), ignore_index=-1,
                               reduction="sum") / count
    cls = ScheduleInterleaved1F1B if kind == "interleaved" else ScheduleInterleavedZeroBubble
    return cls(chunks, m, loss_fn=loss_fn, scale_grads=False)


def _torch_order(schedule, rank, p):
    """torch's compute actions on `rank` as ours: (kind, chunk, mb), its "I" (input-only
    backward) our split B."""
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    return [(kinds[a.computation_type.value], a.stage_index // p, a.microbatch_index)
            for a in schedule.pipeline_order[rank] if a is not None]


def _on_ranks(p: int):
    rank, full = dist.get_rank(), _full()
    stages = {"interleaved": pl.stage_for("interleaved", full, None, V), "zb-h1": pl.stage_for("zb-h1", full)}
    out = {s: {"names": [n for n, _ in st.named_parameters()], "chunks": [list(c) for c in st.chunks]
               if s == "interleaved" else [list(st.layers)], "describe": st.describe()} for s, st in stages.items()}
    for sched, m in CASES[p]:
        stage = stages[sched]
        stage.zero_grad(set_to_none=True)
        rec = pm.StepRecord()
        loss = pl.run_schedule(stage, _micro_batches(m), sched, record=rec)
        out[sched, m] = (loss, {n: q.grad.clone() for n, q in stage.named_parameters()}, rec)
    stage, rec = stages["zb-h1"], pm.StepRecord(count_saved=False)  # a timed step: no byte count
    stage.zero_grad(set_to_none=True)
    pl.run_schedule(stage, _micro_batches(CASES[p][-1][1]), "zb-h1", record=rec)
    out["uncounted"] = ({n: q.grad.clone() for n, q in stage.named_parameters()}, rec)
    x, y = _micro_batches(1)[0]  # refused before any message: none, or of two shapes
    for sched, stage in (("1f1b", pl.Stage(full)), *stages.items()):
        for what, mbs in (("empty", []), ("ragged", [(x, y)] * 3 + [(x[:1], y[:1])])):  # 4: groups of p
            with pytest.raises(ValueError) as e:
                pl.run_schedule(stage, mbs, sched)
            out["said", sched, what] = str(e.value)
    for sched, v in (("interleaved", V), ("zb-h1", 1)):  # torch's, on stages of the same weights
        theirs = pl.InterleavedStage(full, None, v)
        out["torch order", sched] = {m: _torch_order(_torch_schedule(sched, theirs, m), rank, p)
                                     for s, m in CASES[p] if s == sched}
        m = TORCH[sched, p]
        mbs = _micro_batches(m)
        x, y = torch.cat([a for a, _ in mbs]), torch.cat([b for _, b in mbs])
        _torch_schedule(sched, theirs, m).step(*([x] if theirs.is_first else []),
                                                **({"target": y} if theirs.is_last else {}))
        theirs.allreduce_tied_grads()  # (not the schedule's job: the same swap as ours)
        out["torch", sched] = {n: q.grad.clone() for n, q in theirs.named_parameters()}
    return out


@pytest.fixture(scope="module")
def ranks(pool):
    """{pp: [what rank r returned]}: one pool call per world size."""
    return {p: pool(p).run(_on_ranks, p) for p in (2, 4)}


@pytest.fixture(scope="module")
def oracle():
    """{m: (loss, {name: grad})}: one process accumulating over the m micro-batches."""
    return {m: accumulated(_full(), _micro_batches(m)) for m in sorted({m for c in CASES.values() for _, m in c})}


ALL = [(p, sched, m) for p, cases in CASES.items() for sched, m in cases]


# ---------------------------------------------------------------- equal to one process, and to torch

@pytest.mark.parametrize("p, sched, m", ALL)
def test_gradients_and_loss_equal_one_process(ranks, oracle, p, sched, m):
    ref_loss, ref_grads = oracle[m]
    losses = [r[sched, m][0] for r in ranks[p]]
    assert all(lo == losses[0] for lo in losses)
    assert losses[0] == pytest.approx(ref_loss, rel=1e-6)
    for s, r in enumerate(ranks[p]):
        for name, grad in r[sched, m][1].items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda e: f"rank {s} {name}: {e}")
    assert torch.equal(ranks[p][0][sched, m][1]["wte.weight"], ranks[p][-1][sched, m][1]["wte.weight"])


@pytest.mark.parametrize("p, sched", [(p, s) for s, p in TORCH])
def test_gradients_equal_torchs_schedule_on_the_same_stages(ranks, p, sched):
    m = TORCH[sched, p]
    for s, r in enumerate(ranks[p]):
        ours, theirs = r[sched, m][1], r["torch", sched]
        assert ours.keys() == theirs.keys()
        for name in ours:  # to the bit: the same modules and arithmetic, only who calls them differs
            assert torch.equal(ours[name], theirs[name]), (s, name)


@pytest.mark.parametrize("p", [2, 4])
def test_chunks_are_held_by_name_round_the_ring(ranks, p):
    full = {n for n, _ in _full().named_parameters()}
    cuts = pl.chunk_layers(CFG["n_layer"], p, V)
    for sched in ("interleaved", "zb-h1"):
        names = [set(r[sched]["names"]) for r in ranks[p]]
        assert set().union(*names) == full
        for n in full:  # one rank each, but the tied matrix on the first and the last
            holders = [s for s in range(p) if n in names[s]]
            assert holders == ([0, p - 1] if n == "wte.weight" else holders[:1]), n
    assert [r["interleaved"]["chunks"] for r in ranks[p]] == [[list(c) for c in cuts[s::p]] for s in range(p)]
    assert all(r["interleaved"]["describe"] == pl.describe_chunks(CFG["n_layer"], p, V) for r in ranks[p])
    assert pl.describe_chunks(8, 2, 2) == \
        "stage 0: embeddings + blocks 0-1, 4-5 | stage 1: blocks 2-3, 6-7 + ln_f + head"


# ---------------------------------------------------------------- the orders, and what they hold

def _flat(sched, p, m, rank):
    v = V if sched == "interleaved" else 1
    return [(k, vs // p, mb) for slot in pl.SLOTS[sched](p, v, m, rank) for k, vs, mb in slot]


@pytest.mark.parametrize("p", [2, 4])
def test_each_rank_ran_its_slots_in_torchs_order(ranks, p):
    for s, r in enumerate(ranks[p]):
        for sched, m in CASES[p]:
            assert r[sched, m][2].actions() == _flat(sched, p, m, s), (s, sched, m)
            assert r["torch order", sched][m] == _flat(sched, p, m, s), (s, sched, m)


@pytest.mark.parametrize("p", [2, 4])
def test_no_micro_batches_or_ragged_ones_are_refused_on_every_stage(ranks, p):
    for r in ranks[p]:
        for sched in ("1f1b", "interleaved", "zb-h1"):
            assert r["said", sched, "empty"] == "no micro-batches to step on: give at least one (x, y)"
            assert r["said", sched, "ragged"].startswith(
                f"pipeline micro-batches must all be (x, y) of one shape (b, T), got [(1, {T}), (2, {T})]")


@pytest.mark.parametrize("p", [2, 4])
def test_a_step_that_does_not_count_saved_bytes_records_the_same_steps_and_gradients(ranks, p):
    for r in ranks[p]:
        grads, rec = r["uncounted"]
        counted = r[CASES[p][-1]]
        assert rec.saved_bytes == [] and counted[2].saved_bytes
        assert rec.actions() == counted[2].actions()
        assert all(torch.equal(g, counted[1][n]) for n, g in grads.items())


@pytest.mark.parametrize("p", [2, 4])
def test_in_flight_and_saved_bytes_equal_the_formulas(ranks, p):
    cfg, cuts = GPTConfig(**CFG), pl.chunk_layers(CFG["n_layer"], p, V)
    for s, r in enumerate(ranks[p]):
        for sched, m in CASES[p]:
            rec, v = r[sched, m][2], (V if sched == "interleaved" else 1)
            per = {c: pm.stage_activation_bytes(cfg, B, T, len(cut), c * p + s == 0, c * p + s == p * v - 1)
                   for c, cut in enumerate(cuts[s::p] if v > 1 else [pl.split_layers(CFG["n_layer"], p)[s]])}
            acts = rec.actions()
            assert rec.saved_bytes == [per[c] for k, c, _ in acts if k == "F"], (s, sched, m)
            k = pm.in_flight_formula(sched, p, s, m, v)
            assert rec.peak_in_flight == k == pm.in_flight(acts), (s, sched, m)
            held, most = set(), 0  # the bytes held, walked by hand: a forward's until its W or B
            for kind, c, mb in acts:
                if kind == "F":
                    held.add((c, mb))
                elif kind == ("W" if sched == "zb-h1" else "B"):
                    held.remove((c, mb))
                most = max(most, sum(per[c] for c, _ in held))
            assert rec.peak_saved == most, (s, sched, m)
            if sched == "zb-h1":  # W's pending (B done, W not) on stage s: at most s + 1
                pend = [sum(1 for a in acts[:i + 1] if a[0] == "B") - sum(1 for a in acts[:i + 1] if a[0] == "W")
                        for i in range(len(acts))]
                assert max(pend) == pm.pending_w_formula(p, s, m) == min(s + 1, m), (s, m)
    # the memory price of interleaving: rank 0 holds p + (p - 1)/v stage micro-batches, 1F1B p
    assert Fraction(pm.in_flight_formula("interleaved", 4, 0, 8, 2), 2) == 4 + Fraction(3, 2)


# ---------------------------------------------------------------- the messages, replayed

def _replay(p, v, m, sched):
    """Every rank's batches in turn under the strictest rule; "ok", or what went wrong."""
    progs = [orders.talks(pl.SLOTS[sched](p, v, m, r), p, p * v) for r in range(p)]
    at, done = [0] * p, [set() for _ in range(p)]
    while not all(at[r] == len(progs[r]) for r in range(p)):
        moved = False
        for a in range(p):
            if at[a] == len(progs[a]):
                continue
            sends, _ = progs[a][at[a]]
            for i, (what, vs, mb, peer) in enumerate(sends):
                if i in done[a] or at[peer] == len(progs[peer]):
                    continue
                theirs = [(j, msg) for j, msg in enumerate(progs[peer][at[peer]][1])
                          if msg[3] == a and ("r", j) not in done[peer]]
                if theirs:  # the first receive from a that peer has posted must be this message
                    j, (w2, vs2, mb2, _) = theirs[0]
                    if (w2, vs2, mb2) != (what, vs + 1 if what == "act" else vs - 1, mb):
                        return f"crossed on {a}->{peer}: {what} {vs} {mb} met {w2} {vs2} {mb2}"
                    done[a].add(i)
                    done[peer].add(("r", j))
                    moved = True
        for r in range(p):
            if at[r] < len(progs[r]) and len(done[r]) == sum(map(len, progs[r][at[r]])):
                at[r], done[r], moved = at[r] + 1, set(), True
        if not moved:
            return f"deadlock at {at}"
    return "ok"


def test_messages_on_every_link_match_and_never_deadlock():
    for p in (2, 3, 4, 6):
        for v in (1, 2, 3):
            for m in (p, 2 * p, 3 * p):
                assert _replay(p, v, m, "interleaved") == "ok", (p, v, m)
        for m in range(1, 3 * p + 1):
            assert _replay(p, 1, m, "zb-h1") == "ok", (p, m)


# ---------------------------------------------------------------- the ideal timeline and the closed forms

def _ideal(order_of, p, n_vs, cost):
    """Written apart from minidist: each step as soon as its input and its rank are free."""
    done, free, events = {}, [0] * p, [[] for _ in range(p)]
    queues = [list(order_of(r)) for r in range(p)]
    while any(queues):
        left = sum(map(len, queues))
        for r in range(p):
            while queues[r]:
                kind, vs, mb = queues[r][0]
                dep = {"F": ("F", vs - 1, mb) if vs else None, "W": ("B", vs, mb),
                       "B": ("B", vs + 1, mb) if vs < n_vs - 1 else ("F", vs, mb)}[kind]
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done.get(dep, 0))
                free[r] = done[kind, vs, mb] = start + cost[kind]
                events[r].append((kind, vs // p, mb, start, free[r]))
                queues[r].pop(0)
        assert sum(map(len, queues)) < left, "deadlock"
    return events


def _idle(recs):
    span = max(e.end for r in recs for e in r.events)
    return [span - sum(e.end - e.start for e in r.events) for r in recs]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_interleaved_ideal_bubble_is_the_closed_form(p):
    for v in (2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            for f, b in ((1, 1), (1, 2), (2, 3)):
                recs = orders.ideal_timeline("interleaved", p, m, v, F=f, B=b)
                cost = {"F": Fraction(f, v), "B": Fraction(b, v)}
                mine = [[(e.kind, e.chunk, e.mb, e.start, e.end) for e in r.events] for r in recs]
                assert mine == _ideal(lambda r: [a for s in pl.interleaved_slots(p, v, m, r) for a in s],
                                      p, p * v, cost)
                assert _idle(recs) == [Fraction((p - 1) * (f + b), v)] * p, (v, m, f, b)
                assert pm.bubble_fraction(recs) == pytest.approx(pm.interleaved_bubble_formula(p, m, v))
                assert [pm.in_flight(r.actions()) for r in recs] == \
                       [pm.in_flight_formula("interleaved", p, s, m, v) for s in range(p)]
    assert pm.interleaved_bubble_formula(4, 8, 2) == pytest.approx(3 / 19)  # Megatron's 3/16 of the work


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zb_h1_ideal_bubble_is_the_closed_form(p):
    for m in (p, p + 1, 2 * p, 3 * p):
        for f, b, w in ((1, 1, 1), (1, 2, 1), (2, 3, 1), (3, 2, 2), (1, 1, 2), (2, 1, 3), (1, 1, Fraction(1, 2))):
            recs = orders.ideal_timeline("zb-h1", p, m, F=f, B=b, W=w)
            mine = [[(e.kind, e.chunk, e.mb, e.start, e.end) for e in r.events] for r in recs]
            assert mine == _ideal(lambda s: [a for sl in pl.zb_h1_slots(p, 1, m, s) for a in sl], p, p,
                                  {"F": f, "B": b, "W": w})
            assert _idle(recs) == [pm.zb_h1_idle(p, m, f, b, w)] * p, (m, f, b, w)
            assert [pm.in_flight(r.actions()) for r in recs] == [min(p, m)] * p
    # F = B = W: a third of 1F1B's (p - 1)(F + B + W); the paper's (p - 1)(F + B - W) while W is shortest
    assert pm.zb_h1_idle(p, p, 1, 1, 1) * 3 == (p - 1) * 3
    assert pm.zb_h1_idle(p, p, 2, 3, 1) == (p - 1) * 4 and pm.zb_h1_idle(p, p, 1, 1, 2) == (p - 1) * 1


def test_step_units_are_the_ideal_timelines_span():
    """What the planner prices (minidist/compose/plan_mesh.py): a step of step_units micro-batches'
    work, F + B = 3 units each (ZB-H1: F = B = W = 1), for every m, not only the closed forms' range."""
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (p, 2 * p, 3 * p):
                span = max(e.end for r in orders.ideal_timeline("interleaved", p, m, v) for e in r.events)
                assert span == 3 * Fraction(pm.step_units("interleaved", p, m, v)).limit_denominator(100), (p, v, m)
        for m in range(1, 3 * p + 1):
            span = max(e.end for r in orders.ideal_timeline("zb-h1", p, m, B=1, W=1) for e in r.events)
            assert span == 3 * Fraction(pm.step_units("zb-h1", p, m)).limit_denominator(100), (p, m)
            assert pm.schedule_bubble("zb-h1", p, m) == pytest.approx(1 - m / (span / 3))
        assert pm.schedule_bubble("1f1b", p, 4) == pm.bubble_formula(p, 4) == pm.schedule_bubble("gpipe", p, 4)


def test_split_backward_holds_the_formulas_output_gradients_and_misses_no_parameter():
    """Between B and W a micro-batch holds its layers' output gradients: exactly
    minidist.memory.output_grad_bytes (fp32 and bf16, 1 and 3 blocks: each term pinned). A
    parameter read outside its module's call (as the position table under sequence parallelism)
    gets its gradient in B: B and W together equal one backward."""
    from minidist.memory.estimate import output_grad_bytes
    from minidist.scaler import autocast
    for n, precision in ((1, "fp32"), (3, "fp32"), (3, "bf16")):
        torch.manual_seed(n)
        cfg = GPTConfig(n_layer=n, n_head=2, n_embd=16, block_size=8, vocab_size=40)
        model, (x, y) = GPT(cfg), _micro_batches(1)[0]
        x, y = x[:, :8] % 40, y[:, :8] % 40
        with pl.capture(model) as noted, autocast(torch.device("cpu"), precision):
            _, loss = model(x, y, reduction="sum")
        _, pending = pl.backward_input(loss, None, None, noted)
        held = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for _, _, g in pending}
        assert sum(held.values()) == output_grad_bytes(cfg, *x.shape, n, True, True, precision), (n, precision)

    class Odd(nn.Module):  # a table read by F.embedding, beside a Linear called as a module
        def __init__(self):
            super().__init__()
            self.table, self.lin = nn.Embedding(8, 4), nn.Linear(4, 4)

        def forward(self, i):
            return self.lin(F.embedding(i, self.table.weight)).square().sum()
    torch.manual_seed(0)
    odd, i = Odd(), torch.tensor([1, 3, 3])
    odd(i).backward()
    want = {n: q.grad.clone() for n, q in odd.named_parameters()}
    odd.zero_grad(set_to_none=True)
    with pl.capture(odd) as noted:
        loss = odd(i)
    _, pending = pl.backward_input(loss, None, None, noted)
    assert [q for q in noted.others] == [odd.table.weight] and odd.lin.weight.grad is None
    pl.backward_weights(pending)
    for n, q in odd.named_parameters():
        torch.testing.assert_close(q.grad, want[n], rtol=0, atol=0)


# ---------------------------------------------------------------- what is refused

def test_impossible_requests_are_refused_with_what_to_use():
    with pytest.raises(ValueError, match="groups of p = 4.*got 6; use 4 or 8"):
        pl.interleaved_slots(4, 2, 6, 0)
    with pytest.raises(ValueError, match="use 1, or interleaved"):
        pl.zb_h1_slots(2, 2, 4, 0)
    with pytest.raises(ValueError, match="use --pp-virtual-stages 1 to 2"):
        pl.chunk_layers(4, 2, 3)
    with pytest.raises(ValueError, match="gpipe, 1f1b, interleaved, zb-h1"):
        pl.run_schedule(None, [], "zigzag")
    with pytest.raises(ValueError, match="m = p = 4"):
        pm.zb_h1_idle(4, 3)
