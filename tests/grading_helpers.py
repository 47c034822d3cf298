"""What the exercise tests (tests/test_exercise_05.py to 08) share: which of an exercise's
checks a grading run failed, each named by a short key ({key: a phrase of the check's
name}), and the proof that those keys name each check exactly once."""

from exercises import grade as G


def failed_checks(result, keys: dict) -> tuple[set, dict]:
    """(the keys of the failed checks, {failed check's name: its message})."""
    failed = {c.name: c.message for c in result.checks if not c.ok}
    return {k for k, v in keys.items() if any(v in name for name in failed)}, failed


def message_of(messages: dict, keys: dict, key: str) -> str:
    """The message of the failed check that `key` names."""
    return next(m for name, m in messages.items() if keys[key] in name)


def assert_keys_name_each_check_once(nn: str, keys: dict) -> None:
    names = [c.name for c in G.checks_of(nn)]
    assert all(sum(v in n for n in names) == 1 for v in keys.values()), names
    assert len(names) == len(keys)
