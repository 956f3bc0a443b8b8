"""Two ways to read a logical slot: the walsender protocol and the SQL interface.

Both yield raw pgoutput messages in stream order — one at a time as ``(lsn, bytes)``, or
many at once packed in a :class:`~pgsieve.wire.batch.MessageBatch` — grouped into
*sessions*: each session is one decoding run on the server, which starts again from the
slot's confirmed position and re-sends Relation messages and any transaction not yet
committed. The consumer therefore resets its assembler at every session start and skips
transactions it already delivered. Neither transport ever moves the slot by itself: only
:meth:`confirm`, called with what the target durably holds, does.

* :class:`~.walsender.WalsenderTransport` — ``START_REPLICATION SLOT … LOGICAL`` at the
  libpq level (:mod:`pgsieve.streaming.replication`). Push: low latency when live.
  Answers keepalives with what was confirmed and nothing else, reconnects with backoff.
* :class:`~.sql.SqlTransport` — ``pg_logical_slot_peek_binary_changes`` up to a bounded LSN
  window, then ``pg_replication_slot_advance`` on confirm. Polling, but the server
  decodes faster than the walsender ships: it wins on a backlog. Each peek decodes again
  from the slot's restart point. The server aggregates the window into chunks of a few
  MB, so our side does no Python-level work per message, and a large window is decoded
  by two backends at once; windows too large to aggregate are read row by row.

What they share (the options, the :class:`~.base.Transport` protocol, its errors) is in
:mod:`.base`; the SQL interface's COPY reading of a peek in :mod:`.peek`.
"""
