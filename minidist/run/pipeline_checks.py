"""The checks of train_gpt's pipeline flags (--pp, --pp-schedule, --pp-virtual-stages) against
the world, the model and the other flags, run before any process-group work, so that what a
schedule would refuse on the ranks is refused here first, saying what to use. Chapter 11
(chapters/11_pipeline.md and its appendix, section G); minidist/run/flags.py calls
`check_pipeline`. Exercised by `pytest tests/test_train_gpt.py -k pp`.
"""

from __future__ import annotations


def check_pipeline(p, args, world_size: int) -> None:
    """--pp and its schedule against the world, the model and the other flags."""
    pp, what, sched, v = args.pp, f"--pp {args.pp}", args.pp_schedule, args.pp_virtual_stages
    if pp == 1:
        if sched != "1f1b" or v != 2:  # (the defaults: what nobody chose)
            flag = f"--pp-schedule {sched}" if sched != "1f1b" else f"--pp-virtual-stages {v}"
            p.error(f"{flag} orders the stages of a pipeline and this run has one stage (--pp 1): "
                    f"add --pp 2 or more, or drop {flag.split()[0]}")
        return
    if world_size % (pp * args.tp):
        n = pp * args.tp
        p.error(f"{what}{f' x --tp {args.tp}' if args.tp > 1 else ''} does not divide the world of "
                f"{world_size} ranks: start a multiple of {n} ranks (world = dp x tp x pp), or change --pp")
    if args.n_layer < pp:
        p.error(f"{what}: each stage holds at least one block and the model has --n-layer "
                f"{args.n_layer}: use --pp <= {args.n_layer}")
    if args.zero_stage in (2, 3):
        p.error(f"{what} with --zero-stage {args.zero_stage}: ZeRO-{args.zero_stage} would "
                f"{'reduce-scatter the gradients' if args.zero_stage == 2 else 're-gather the parameters'} "
                "for every micro-batch of the pipeline (the field pairs pipelining with ZeRO-1 only): "
                "use --zero-stage 1 or 0")
    if sched != "interleaved" and v != 2:  # (2, the default, is the only value nobody chose)
        p.error(f"--pp-virtual-stages {v} cuts each stage into chunks for interleaved 1F1B only: "
                f"add --pp-schedule interleaved, or drop --pp-virtual-stages")
    if sched == "interleaved":
        if v < 2:  # one chunk per stage is plain 1F1B, whose warm-up is shorter
            p.error(f"{what} --pp-schedule interleaved --pp-virtual-stages {v}: interleaving needs 2 or "
                    "more chunks per stage: use --pp-virtual-stages 2, or --pp-schedule 1f1b")
        if args.n_layer < pp * v:
            fewer = f"--pp-virtual-stages {args.n_layer // pp}" if args.n_layer >= 2 * pp else "--pp-schedule 1f1b"
            p.error(f"{what} --pp-schedule interleaved --pp-virtual-stages {v}: {pp * v} chunks of at least one "
                    f"block each, and the model has --n-layer {args.n_layer}: use --n-layer >= {pp * v}, or {fewer}")
        m = args.grad_accum_steps
        if m != "auto" and m % pp:  # a group of pp micro-batches is one trip round the ring
            near = sorted({max(pp, m - m % pp), m - m % pp + pp})
            p.error(f"{what} --pp-schedule interleaved takes the micro-batches in groups of {pp} and "
                    f"--grad-accum-steps is {m}: use --grad-accum-steps {' or '.join(map(str, near))}")
    if sched == "zb-h1" and args.activation_checkpointing == "blocks":
        p.error(f"{what} --pp-schedule zb-h1 splits each backward by the layers' outputs, which "
                "recomputation would make again: drop --activation-checkpointing, or use --pp-schedule 1f1b")
