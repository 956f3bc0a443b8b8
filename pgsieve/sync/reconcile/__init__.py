"""A filter change's reconciliation: what a change to a publication's filters or columns
does to the rows its subscriptions already hold, in one package.

* :mod:`.filterchange` — what a change does (its plan: rows to add and remove per table)
  and the jobs it starts, with the change point every stream of the source passes;
* :mod:`.moved` — a change reconciled by the rows it moves: the lock, snapshot and marker
  in the ALTER's transaction, the rows staged; :mod:`.markers` — the stream's side: a
  marker's staged rows merged in stream order; :mod:`.parked_merge` — or merged as they are
  read, for a stream that waits at the marker;
* :mod:`.diffsync` — or by comparing target and source under a snapshot (``mode: diff``,
  also a resync's): :mod:`.diffrun`'s three ways to compare, :mod:`.hashdiff` the pure
  key/hash comparison, :mod:`.keyranges` a diff's key ranges for Spark.

It lives under :mod:`pgsieve.sync` because it runs as sync jobs and reuses their copy pipe
(:mod:`pgsieve.sync.copypipe`), plans and snapshots; the streams (:mod:`pgsieve.streaming`)
and the API's services call into it, never the reverse.
"""
