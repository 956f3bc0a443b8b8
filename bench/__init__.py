"""Benchmarks: runnable scripts that measure pgsieve side by side with its peers.

Each ``bench/<name>.py`` prints figures and ratios from one run and writes them as a JSON
report (:mod:`bench.report`); ``bench/RESULTS.md`` keeps the current figure of each
question, one row each, with the command that produced it. ``python -m bench`` lists them.
"""

import os

# Every connection checks the connection policy (issue 54), in-process ones too: the
# benchmarks' clusters are on 127.0.0.1, and PGSIEVE_ALLOWED_HOSTS allows no host by
# default.
os.environ.setdefault("PGSIEVE_ALLOWED_HOSTS", "127.0.0.1")
