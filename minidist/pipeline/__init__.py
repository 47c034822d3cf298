"""Chapter 11, pipeline parallelism (chapters/11_pipeline.md): the GPT cut into stages, and the
schedules that order the micro-batches. Read in this order:

    schedules.py    stages, point-to-point exchange, GPipe and 1F1B
    measure.py      a step's timeline, bubble and in-flight activations beside their formulas
    orders.py       interleaved 1F1B and ZB-H1 as lists: each rank's slots, their messages,
                    the ideal timeline
    interleaved.py  a stage of v chunks: rank r holds chunks r, r + p, r + 2p, ...
    split.py        a backward split into B (the input's gradient) and W (the weights')
    slots.py        run_schedule: one step of any of the four schedules, by name

What joins a pipeline to data and tensor parallelism is in minidist/compose/pipeline_sync.py.
"""

from minidist.pipeline.schedules import (split_layers, describe_cut, Stage, exchange, Observer,
    gpipe, one_f_one_b, SCHEDULES, pipeline_step)
from minidist.pipeline.measure import Event, StepRecord, count_saved_bytes
from minidist.pipeline.orders import interleaved_slots, zb_h1_slots, SLOTS, talks, ideal_timeline
from minidist.pipeline.interleaved import chunk_layers, describe_chunks, InterleavedStage
from minidist.pipeline.split import capture, backward_input, backward_weights
from minidist.pipeline.slots import ALL_SCHEDULES, stage_for, run_schedule

__all__ = ["split_layers", "describe_cut", "Stage", "exchange", "Observer", "gpipe", "one_f_one_b", "SCHEDULES",
           "pipeline_step", "Event", "StepRecord", "count_saved_bytes", "interleaved_slots", "zb_h1_slots", "SLOTS",
           "talks", "ideal_timeline", "chunk_layers", "describe_chunks", "InterleavedStage", "capture",
           "backward_input", "backward_weights", "ALL_SCHEDULES", "stage_for", "run_schedule"]
