"""Exercise 11's grader against planted mistakes: each loses the checks it belongs to and no
other, a rule broken in one part scores that part 0 naming the rule and the line, and the
shipped draft's message reports the symptom, not the fix. Each variant is the solution
(tests/solutions/11_pipeline.py) with one change, graded once, with a 2 s deadlock watchdog.
(tests/test_exercises.py grades the stubs, the reference and the solution.)
"""

from pathlib import Path

import pytest

from exercises.grader import checks_11 as C
from exercises.grader import core
from exercises.grader.rules import RuleBroken, watch

SOLUTION = (Path(__file__).parent / "solutions" / "11_pipeline.py").read_text()
GRADS, ORDER, DEADLOCK, DRAFT = (c.name for c in core.checks_of("11"))

# name -> the changes [(the solution's text, what replaces it)]
START, BELOW, ABOVE = ("    even = run.stage % 2 == 0\n", "if even:                                  # the pair on",
                       "if even:\n            _send(run, g")
VARIANTS = {
    "both ends send first": [("even = run.stage % 2 == 0", "even = True")],
    "activations first on every link": [(BELOW, "if True:  #"), (ABOVE, ABOVE.replace("even", "False"))],
    "GPipe's order": [("def draft_gpipe(", "def one_f_one_b(run, m):\n    draft_gpipe(run, m)\n\n\n"
                                           "def draft_gpipe(")],
    "one receive buffer": [("def _send(", "_BUF = {}\n\n\ndef _send("),
                           ("buf = torch.empty(run.shape)", "buf = _BUF.setdefault(peer, torch.empty(run.shape))")],
    "isend and irecv": [("dist.send(t, peer, group=run.group)", "dist.isend(t, peer, group=run.group).wait()"),
                        ("dist.recv(buf, peer, group=run.group)", "dist.irecv(buf, peer, group=run.group).wait()")],
    "a barrier": [(START, "    dist.barrier()\n" + START)],
    "the stubs": [],  # the shipped file itself
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    results, folder = {}, tmp_path_factory.mktemp("ex11")

    def grade(name):
        if name not in results:
            text = SOLUTION
            for old, new in VARIANTS[name]:
                assert old in text, (name, old)
                text = text.replace(old, new)
            path = folder / f"v{len(results)}" / "11_pipeline.py"
            path.parent.mkdir()
            path.write_text(text)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(C, "CASE_TIMEOUT_S", 2.0)  # the deadlock watchdog
                r = core.grade("11", path=path if VARIANTS[name] else None)
            results[name] = {c.name: c for c in r.checks}
        return results[name]
    return grade


def failing(result) -> set:
    return {name for name, c in result.items() if not c.ok}


def test_a_deadlock_is_caught_and_reported_with_where_each_stage_waited(graded):
    r = graded("both ends send first")
    assert failing(r) == {GRADS, ORDER, DEADLOCK}
    msg = r[DEADLOCK].message
    assert "at p=2, m=5 it deadlocked" in msg, msg
    for s, peer in ((0, 1), (1, 0)):
        assert f"stage {s} waited in a send to stage {peer} (" in msg and "11_pipeline.py:" in msg, msg
    assert "deadlocked" in r[GRADS].message and "deadlocked" in r[ORDER].message


def test_gpipe_order_loses_the_order_check_only(graded):
    r = graded("GPipe's order")
    assert failing(r) == {ORDER}
    assert "stage 0 ran F0 F1 F2 F3 F4 B0" in r[ORDER].message, r[ORDER].message
    assert "1F1B runs F0 F1 B0 F2 B1" in r[ORDER].message, r[ORDER].message


def test_a_reused_receive_buffer_gives_wrong_gradients_at_three_stages(graded):
    r = graded("one receive buffer")
    assert failing(r) == {GRADS}
    msg = r[GRADS].message
    assert "at p=3" in msg and "On stage 1," in msg and "blocks.2.ln_1.weight" in msg, msg
    assert "input gradients its backward returned for micro-batch(es) 0 " in msg, msg


@pytest.mark.parametrize("name, what", [("isend and irecv", "dist.isend was called at "),
                                        ("a barrier", "dist.barrier was called at ")])
def test_a_broken_rule_scores_its_part_0_naming_the_call_and_line(graded, name, what):
    r = graded(name)
    assert failing(r) == {GRADS, ORDER, DEADLOCK}, name  # the draft, the other part, still scores
    for check in (GRADS, ORDER, DEADLOCK):
        msg = r[check].message
        assert what in msg and "11_pipeline.py:" in msg and "this part scores 0" in msg, msg


def test_the_shipped_draft_reports_the_symptom_not_the_fix(graded):
    msg = graded("the stubs")[DRAFT].message
    for said in ("at p=2, m=2", "On stage 1,", "blocks.2.ln_1.weight", "micro-batch(es) 0 ",
                 "right for m = 1"):
        assert said in msg, msg
    for fix in ("buffer", "reuse", "overwr", "fresh", "alloc"):
        assert fix not in msg.lower(), msg


def test_another_order_that_cannot_deadlock_scores_full_marks(graded):
    assert not failing(graded("activations first on every link"))


def test_torch_pipelining_is_refused_where_it_is_used():
    with pytest.raises(RuleBroken, match=r"pipelining\.ScheduleGPipe was called at .*test_exercise_11\.py:"), \
            watch(C.RULES):
        from torch.distributed.pipelining import ScheduleGPipe  # imported once watched: still seen
        ScheduleGPipe(None, 2)
