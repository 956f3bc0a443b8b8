"""Publications pgsieve manages on a source: a definition (:mod:`.definition`) validated
against the source (:mod:`.validate`) and applied in one transaction (:mod:`.service`),
its drift from the catalog (:mod:`.drift`), the desired state in the metadata store kept
in step with them (:mod:`.store`), and the source catalog as PostgreSQL stores it
(:mod:`.catalog`). What a change means for the subscriptions using it is the sync domain's
(:mod:`pgsieve.sync.reconcile`), composed with a change in
:mod:`pgsieve.subscriptions.publication_change`.
"""
