"""The public door to launch(fn, world_size, *args): run a function in N local processes,
each in one process group, from a test, a notebook or an exercise.

Chapter 02 (chapters/02_collectives.md). The code lives in minidist/run/launch.py; this
module keeps the name every notebook imports:
`python -c "from minidist.launch import launch; print(launch(abs, 2, -1))"`.
"""

from minidist.run.launch import LaunchError, launch

__all__ = ["launch", "LaunchError"]
