"""Applying whole committed transactions to a target: the pure part.

* :mod:`.batch` — what the consumer hands to the apply job (:class:`ApplyBatch`) and what
  comes back (:class:`ApplyResult`), plus the errors that stop a pipeline.
"""
