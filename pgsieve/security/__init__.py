"""Who may do what, and the record of it: scoped API tokens (:mod:`.tokens`), the
audit log of every control-plane change (:mod:`.audit`), re-encrypting stored secrets
under a new key (:mod:`.rotation`).
"""
