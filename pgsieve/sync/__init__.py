"""Initial sync and resync: the job (:mod:`.syncjob`), its plan (:mod:`.syncplan`),
the exported snapshot helper (:mod:`.snapshot`), a table's catch-up from its own slot
(:mod:`.tablesync`) and the diff that reconciles a filter change (:mod:`.diffsync`).
The copy's libpq pipe is :mod:`.copypipe` and a diff's key ranges :mod:`.keyranges`; their
Spark jobs are :mod:`pgsieve.spark.sync`.
"""
