"""The workshop: what runs and measures the techniques, apart from the chapter modules that
teach them (minidist/*.py). Chapter 08 (chapters/08_at_scale.md) describes the run machinery:

    flags.py               train_gpt's flags: parsed and checked before any process group;
    flag_types.py          each flag's range, where argparse reads it;
    flag_checks.py         the checks that span several flags, and --config files
    outputs.py             what a run leaves (metrics.jsonl, summary.json, loss.png) and how it ends

The benchmarks are the workshop's other half, minidist/bench/. Starting processes
(minidist/launch.py, minidist/pool.py) is still at the top level, on the ground floor, under
the public name minidist.launch. Chapter modules import nothing from here
(tests/test_frames.py holds the floor map).
"""
