"""Benchmarks as programs: `python -m minidist.bench NAME|all` (minidist/bench/__main__.py).
Chapter 08 (chapters/08_at_scale.md) gathers them; each file is one benchmark and names
its own chapter: collectives.py (02), ddp.py (03), zero.py (06), muon.py (07), scale.py
(08); report.py writes the report of `all`. Importing this package imports none of them.
"""
