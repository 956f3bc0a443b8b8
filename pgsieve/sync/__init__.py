"""Initial sync and resync: the job (:mod:`.syncjob`), its plan (:mod:`.syncplan`),
the exported snapshot helper (:mod:`.snapshot`), a table's catch-up from its own slot
(:mod:`.tablesync`) and the diff that reconciles a filter change (:mod:`.diffsync`).
"""
