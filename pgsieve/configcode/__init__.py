"""Config as code: ``pgsieve plan|apply -f pgsieve.yaml`` and ``pgsieve export``.

A YAML file states sources, targets, publications (with their row filters) and
subscriptions (with their options); ``plan`` compares it with what the API holds,
``apply`` makes the API hold it (through the same HTTP API a user would call, so every
change is validated, audited and, for a filter change, planned and reconciled as by hand),
``export`` writes the current state as such a file. Secrets never live in the file: a
DSN's password comes from an environment reference (``${SOURCE_DSN}``). See
docs/config-as-code.md.
"""
