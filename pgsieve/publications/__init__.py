"""Publications pgsieve manages on a source: validation and one-transaction changes
(:mod:`.service`) and the source catalog as PostgreSQL stores it (:mod:`.catalog`). What a
change means for the subscriptions using it is the sync domain's
(:mod:`pgsieve.sync.reconcile`).
"""
