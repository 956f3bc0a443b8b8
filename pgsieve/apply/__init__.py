"""Applying whole committed transactions to a target, exactly once.

Pure (no I/O):

* :mod:`.batch` — what the consumer hands to the apply job (:class:`ApplyBatch`) and what
  comes back (:class:`ApplyResult`), plus the errors that stop a pipeline.
* :mod:`.planbuilder`, :mod:`.plan`, :mod:`.net_effect` — one pass over a batch (the
  builder) to its plan: routes, UPDATE images, the net effect per target table and key;
  :mod:`.batcher` cuts the stream into batches.
* :mod:`.columns`, :mod:`.staging`, :mod:`.copytext` — target columns, staging rows
  encoded as COPY text or binary.

At the target (psycopg):

* :mod:`.target` — :class:`TargetWriter`: the target connection (pinned session
  settings), with :mod:`.applied` (the applied-LSN record and the routes fence),
  :mod:`.shapes` (its tables and identities) and :mod:`.stagingtables`.
* :mod:`.merge` — one target transaction merging every staged table;
  :mod:`.sequential` — change by change, where set-based semantics could differ.
* :mod:`.driver` — resolving, fetching unchanged TOAST values and staging from the
  driver process.

The engine:

* :mod:`.engine` — ``apply_batch``: plan → fetch → stage → merge, in the driver or, for
  big batches, through a :class:`~.planner.DistributedPlanner` handed in (Spark's lives
  in :mod:`pgsieve.spark.distributed`; this package never imports ``pgsieve.spark``);
  :mod:`.mergebehind` — a backlog's merges in a thread while the turn reads on.
"""
