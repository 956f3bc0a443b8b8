"""Publications pgsieve manages on a source: validation and one-transaction changes
(:mod:`.service`), the desired state in the metadata store kept in step with them
(:mod:`.store`), and the source catalog as PostgreSQL stores it (:mod:`.catalog`). What a
change means for the subscriptions using it is the sync domain's
(:mod:`pgsieve.sync.reconcile.filterchange`), composed with a change in
:mod:`pgsieve.subscriptions.publication_change`.
"""
