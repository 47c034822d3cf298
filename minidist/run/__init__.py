"""The workshop: what runs and measures the techniques, apart from the chapter modules that
teach them (minidist/*.py). Chapter 08 (chapters/08_at_scale.md) describes the run machinery:

    launch.py, pool.py     processes with a process group, for notebooks, graders and tests
    flags.py               train_gpt's flags: parsed and checked before any process group;
    flag_types.py          each flag's range, where argparse reads it;
    flag_checks.py         the checks that span several flags, and --config files
    outputs.py             what a run leaves (metrics.jsonl, summary.json, loss.png) and how it ends

The benchmarks are the workshop's other half, minidist/bench/. Chapter modules import
nothing from here (tests/test_frames.py holds the floor map).
"""
