"""The Spark adapter: only what touches a SparkContext.

:mod:`.session` (the process's one warm SparkSession), :mod:`.distributed` (a big apply
batch planned and staged as Spark tasks: :class:`~.distributed.SparkPlanner`, the apply
engine's :class:`~pgsieve.apply.planner.DistributedPlanner`), :mod:`.sync` (the Spark
jobs of the initial sync's copy and of a diff's key ranges), :mod:`.standalone` (a local
standalone cluster for tests and benchmarks). The streams and the apply engine never
import this package: :mod:`pgsieve.workers` hands the planner in, as it hands in the
session; the work the tasks do (libpq pipes, the plan) lives with its domain.
"""
