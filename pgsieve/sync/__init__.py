"""Initial sync and resync: the job queue (:mod:`.queue`), the job's runner (:mod:`.syncjob`,
its phases in :mod:`.copyphase`, :mod:`.diffphase`, :mod:`.movedphase`,
:mod:`.jobsnapshots`), its plan (:mod:`.syncplan`),
the exported snapshot helper (:mod:`.snapshot`), a table's catch-up from its own slot
(:mod:`.tablesync`) and the diff that reconciles a filter change (:mod:`.reconcile.diffsync`).
The copy's libpq pipe is :mod:`.copypipe` and a diff's key ranges :mod:`.reconcile.keyranges`; their
Spark jobs are :mod:`pgsieve.spark.sync`.
"""
