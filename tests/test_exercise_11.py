"""Exercise 11's grader: the stubs score 0, minidist scores full, a plain solution written
the way the exercise asks scores full, classic mistakes lose the checks they belong to,
and solutions that break a rule score 0 on the parts they break, naming the rule.

(tests/test_exercises.py proves the stub/reference pair for every exercise too.) The
mistakes and rule-breakers run at p = 2 only, with a shorter watchdog (the grader itself
runs p = 2 and 4). The solutions live at module level: cloudpickle ships them to the
ranks by name.
"""

import importlib
import sys

import pytest
import torch
import torch.distributed as dist

from exercises import checks_11 as C11
from exercises import grade as G
from grading_helpers import assert_keys_name_each_check_once, failed_checks, message_of

EX11 = importlib.import_module("exercises.11_pipeline")

KEYS = {"grads": "gradients equal one process", "in_flight": "micro-batches in flight",
        "deadlock": "no deadlock", "draft": "find the bug"}


# -- 0. a plain solution, written the way the exercise asks

def plain_one_f_one_b(run, m):
    warmup = min(run.stages - run.stage - 1, m)
    steady = m - warmup
    for i in range(warmup):
        EX11.recv_forward(run, i)
        run.forward(i)
        EX11.send_forward(run, i)
    if steady:
        EX11.recv_forward(run, warmup)
    for k in range(steady):
        i, j = warmup + k, k
        run.forward(i)
        EX11.send_forward_recv_backward(run, i, j)
        run.backward(j)
        if i + 1 < m:
            EX11.send_backward_recv_forward(run, j, i + 1)
        else:
            EX11.send_backward(run, j)
    for j in range(steady, m):
        EX11.recv_backward(run, j)
        run.backward(j)
        EX11.send_backward(run, j)


PLAIN = {"one_f_one_b": plain_one_f_one_b, "draft_one_f_one_b": plain_one_f_one_b}


# -- 1. mistakes

def gpipe_order(run, m):
    EX11.gpipe(run, m)  # right gradients, m micro-batches in flight


def first_gradient_before_last_activation(run, m):
    """1F1B, except that where a stage has no steady state (m <= its warm-up, so m < p) it
    waits for the first gradient before sending its last activation down: the stage below
    needs that activation to make the gradient."""
    warmup = min(run.stages - run.stage - 1, m)
    steady = m - warmup
    if steady:
        return plain_one_f_one_b(run, m)
    for i in range(m):
        EX11.recv_forward(run, i)
        run.forward(i)
        if i == m - 1:
            EX11.recv_backward(run, 0)
        EX11.send_forward(run, i)
    for j in range(m):
        if j:
            EX11.recv_backward(run, j)
        run.backward(j)
        EX11.send_backward(run, j)


def shape_handshake_first(run, m):
    """The plain schedule after an extra message on each link (the activation's shape, as
    a tensor): allowed, but not what the contract says each link carries."""
    if run.next is not None:
        dist.send(torch.tensor([C11.MB, C11.T, C11.CFG.n_embd]), run.next, group=run.group)
    if run.prev is not None:
        dist.recv(torch.zeros(3, dtype=torch.long), run.prev, group=run.group)
    plain_one_f_one_b(run, m)


# -- 2. rule-breakers

def torch_pipelining(run, m):
    from torch.distributed.pipelining import Schedule1F1B  # torch's schedule
    Schedule1F1B(None, m)  # trips whether the import did (not loaded yet) or not (loaded)
    plain_one_f_one_b(run, m)


def _loaded_or_imported(name):
    return sys.modules.get(name) or importlib.import_module(name)


def private_pipelining(run, m):
    """A corner of torch's pipelining outside its __all__, its micro-batch splitter."""
    mb = _loaded_or_imported("torch.distributed.pipelining.microbatch")
    mb.split_args_kwargs_into_chunks((torch.zeros(m, 1),), None, m)
    plain_one_f_one_b(run, m)


def schedule_without_its_constructor(run, m):
    """torch's 1F1B made without calling its constructor, then driven."""
    pp = _loaded_or_imported("torch.distributed.pipelining")
    schedule = object.__new__(pp.Schedule1F1B)
    schedule._step_microbatches()
    plain_one_f_one_b(run, m)


class _Talking:
    def __init__(self, run):
        self.run, self.forward, self.backward = run, run.forward, run.backward
        self.s = type("S", (), {"stage": run.stage, "stages": run.stages})

    def talk(self, send_act=None, recv_act=None, send_grad=None, recv_grad=None):
        r = self.run
        if send_act is not None and recv_grad is not None:
            EX11.send_forward_recv_backward(r, send_act, recv_grad)
        elif send_grad is not None and recv_act is not None:
            EX11.send_backward_recv_forward(r, send_grad, recv_act)
        else:
            for i, f in ((send_act, EX11.send_forward), (recv_act, EX11.recv_forward),
                         (send_grad, EX11.send_backward), (recv_grad, EX11.recv_backward)):
                if i is not None:
                    f(r, i)


def minidist_schedule(run, m):
    import minidist.pipeline as pp  # the answer, imported
    pp.one_f_one_b(_Talking(run), m)


def all_reduce_activations(run, m):
    """GPipe whose activations travel down by all-reduce (every stage adds zeros but the
    sender): the right numbers, but a collective."""
    shape = (C11.MB, C11.T, C11.CFG.n_embd)
    for i in range(m):
        if run.stage == 0:
            run.forward(i)
        for link in range(run.stages - 1):
            t = run.output(i).clone() if run.stage == link else torch.zeros(shape)
            dist.all_reduce(t, group=run.group)
            if run.stage == link + 1:
                run.new_input(i).copy_(t)
                run.forward(i)
    for j in range(m):
        EX11.recv_backward(run, j)
        run.backward(j)
        EX11.send_backward(run, j)


def on_the_world_group(run, m):
    """The plain schedule, its messages on the default group instead of run.group."""
    class Elsewhere:
        def __getattr__(self, name):
            return getattr(run, name)
        group = None
    plain_one_f_one_b(Elsewhere(), m)


# --------------------------------------------------------------------- the gradings

@pytest.fixture
def two_stages(monkeypatch):
    monkeypatch.setattr(C11, "WORLD_SIZES", (2,))
    monkeypatch.setattr(C11, "CASE_TIMEOUT_S", 2.0)


def _grade(overrides):
    return G.grade("11", overrides=overrides)


def test_keys_name_each_check_once():
    assert_keys_name_each_check_once("11", KEYS)


def test_stubs_score_zero(monkeypatch):
    monkeypatch.setattr(C11, "CASE_TIMEOUT_S", 2.0)
    r = G.grade("11")
    assert r.points == 0 and r.total == len(KEYS)
    failed, messages = failed_checks(r, KEYS)
    assert failed == set(KEYS)
    assert "deadlocked" in message_of(messages, KEYS, "draft")
    assert "not implemented" in message_of(messages, KEYS, "grads")


def test_reference_scores_full():
    r = G.grade("11", reference=True)
    assert r.points == r.max_points == 10, {c.name: c.message for c in r.checks if not c.ok}


def test_plain_solution_scores_full(two_stages, monkeypatch):
    monkeypatch.setattr(C11, "WORLD_SIZES", (2, 4))
    r = _grade(PLAIN)
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


def test_gpipe_order_has_the_gradients_but_not_the_in_flight_count(two_stages):
    r = _grade({**PLAIN, "one_f_one_b": gpipe_order})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"in_flight"}, messages
    assert "held 8 micro-batches" in message_of(messages, KEYS, "in_flight")


def test_a_schedule_that_deadlocks_when_m_is_below_p_loses_the_deadlock_check(two_stages):
    r = _grade({**PLAIN, "one_f_one_b": first_gradient_before_last_activation})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"deadlock"}, messages
    msg = message_of(messages, KEYS, "deadlock")
    assert "at p=2, m=1 the schedule deadlocked" in msg and "recv gradient 0" in msg, msg


def test_an_extra_message_on_a_link_loses_the_gradient_check(two_stages):
    r = _grade({**PLAIN, "one_f_one_b": shape_handshake_first})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"grads"}, messages
    assert "one message each, nothing else" in message_of(messages, KEYS, "grads")


def test_torch_pipelining_scores_zero_where_used(two_stages):
    r = _grade({**PLAIN, "one_f_one_b": torch_pipelining})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"grads", "in_flight", "deadlock"}, messages
    for key in failed:
        assert "torch.distributed.pipelining" in message_of(messages, KEYS, key)
        assert "scores 0" in message_of(messages, KEYS, key)


def _load_torch_pipelining():
    import torch.distributed.pipelining  # noqa: F401 - as an earlier test or import may leave it
    return True


def test_torch_pipelining_loaded_before_the_part_trips_in_every_corner(two_stages, pool):
    """Once loaded, importing it again trips nothing: then every function, class and
    method it defines is watched, private corners and objects made without a constructor
    included."""
    assert pool(2).run(_load_torch_pipelining) == [True, True]
    r = _grade({"one_f_one_b": private_pipelining, "draft_one_f_one_b": schedule_without_its_constructor})
    failed, messages = failed_checks(r, KEYS)
    assert failed == set(KEYS), messages
    assert "microbatch.split_args_kwargs_into_chunks was called" in message_of(messages, KEYS, "grads")
    assert "_step_microbatches was called" in message_of(messages, KEYS, "draft")
    assert "torch.distributed.pipelining" in message_of(messages, KEYS, "draft")


def test_minidist_pipeline_at_run_time_scores_zero_where_used(two_stages):
    r = _grade({**PLAIN, "draft_one_f_one_b": minidist_schedule})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"draft"}, messages
    assert "minidist.pipeline.schedules.one_f_one_b was called" in message_of(messages, KEYS, "draft")


def test_an_all_reduce_that_moves_activations_scores_zero(two_stages):
    r = _grade({**PLAIN, "one_f_one_b": all_reduce_activations})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"grads", "in_flight", "deadlock"}, messages
    assert "dist.all_reduce" in message_of(messages, KEYS, "grads")
    assert "point-to-point" in message_of(messages, KEYS, "grads")


def test_messages_on_another_group_score_zero(two_stages):
    r = _grade({**PLAIN, "draft_one_f_one_b": on_the_world_group})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"draft"}, messages
    assert "another process group than run.group" in message_of(messages, KEYS, "draft")


CHEATS = {
    "from minidist.pipeline import one_f_one_b as _ref\n": "minidist.pipeline",
    "import minidist.pipeline.measure as pm\n": "minidist.pipeline.measure",
    "from minidist.compose import pipeline_sync\n": "minidist.compose.pipeline_sync",
    "from torch.distributed.pipelining import Schedule1F1B\n": "torch.distributed.pipelining",
    "_move = dist.all_reduce\n": "torch.distributed.all_reduce",
    "from exercises.checks_11 import reference_one_f_one_b\n": "exercises",
    "_pp = getattr(dist, 'pipe' + 'lining')\n": "reached by name",
    "_pp = vars(dist)['pipe' + 'lining']\n": "reached by name",
    "from operator import attrgetter\n": "reached by name",
}


@pytest.mark.parametrize("source", list(CHEATS))
def test_file_check_names_the_line_and_the_rule(source):
    problems = C11.file_problems("import torch.distributed as dist\n" + source)
    assert problems, source
    assert "line 2:" in problems[0] and CHEATS[source] in problems[0], problems


def test_the_stub_file_passes_the_file_check():
    assert C11.file_problems(G.learner_file("11").read_text()) == []


def test_a_file_that_imports_the_answer_scores_zero_everywhere(tmp_path, monkeypatch):
    cheat = tmp_path / "11_pipeline.py"
    cheat.write_text(G.learner_file("11").read_text().replace(
        "import torch.distributed as dist\n",
        "import torch.distributed as dist\nfrom minidist.pipeline import one_f_one_b\n", 1))
    monkeypatch.setattr(G, "learner_file", lambda nn: cheat)
    r = G.grade("11")  # nothing runs
    assert r.points == 0
    assert all("minidist.pipeline" in c.message and "line" in c.message for c in r.checks)
