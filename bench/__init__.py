"""Benchmarks: runnable scripts that measure pgsieve side by side with its peers.

Each ``bench/<name>.py`` prints figures and ratios from one run; results are recorded in
``bench/RESULTS.md`` with the command that produced them. ``python -m bench`` lists them.
"""
