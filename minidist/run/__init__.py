"""The workshop: what runs and measures the techniques, apart from the chapter modules that
teach them (minidist/*.py). Chapter 08 (chapters/08_at_scale.md) describes the run machinery:

    flags.py               train_gpt's flags: parsed and checked before any process group;
    flag_types.py          each flag's range, where argparse reads it;
    flag_checks.py         the checks that span several flags, and --config files
    pipeline_checks.py     the checks of --pp and its schedules (chapter 11)
    environment.py         the environment variables minidist reads, each checked like a flag
    locks.py               one run per output folder (a lock file beside its outputs)
    shards.py              python -m minidist.run.shards: the corpus as token shards
    checkpoints.py         python -m minidist.run.checkpoints: each checkpoint intact, or damaged and where
    plan.py                python -m minidist.run.plan memory|mesh: the planners of chapters 09 and 11
    outputs.py             what a run leaves (metrics.jsonl, summary.json, loss.png) and how it ends
    launch.py              launch(fn, world_size, *args): fn in N local processes (chapter 02;
                           public as minidist.launch, the one name notebooks and exercises import)
    pool.py                Pool / shared_pool: launch's processes kept alive across calls
                           (the tests, the exercise grader)

The benchmarks are the workshop's other half, minidist/bench/. launch.py and pool.py stand on
the ground floor of tests/test_frames.py's floor map (they need only minidist/dist.py), so
that anything may start processes; the rest of run/ is the top floor. Chapter modules
import nothing from here.
"""
