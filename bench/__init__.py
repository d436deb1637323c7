"""Benchmark of fanout (issue 7): a tiny Django app whose fanouts.py every worker autodiscovers.

Run it with ``.venv/bin/python bench/run.py`` (see bench/README.md).
"""
