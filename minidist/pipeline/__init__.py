"""Chapter 11, pipeline parallelism (chapters/11_pipeline.md): the GPT cut into stages, and the
schedules that order the micro-batches. Read in this order:

    schedules.py  stages, point-to-point exchange, GPipe and 1F1B
    measure.py    a step's timeline, bubble and in-flight activations beside their formulas

What joins a pipeline to data and tensor parallelism is in minidist/compose/pipeline_sync.py.
"""

from minidist.pipeline.schedules import (split_layers, describe_cut, Stage, exchange, Observer,
    gpipe, one_f_one_b, SCHEDULES, pipeline_step)
from minidist.pipeline.measure import Event, StepRecord, count_saved_bytes
