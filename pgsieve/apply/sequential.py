"""Change-by-change apply of one table, inside the batch's target transaction.

The set-based merge is the fast path; this is the faithful one, used where the two could
differ: REPLICA IDENTITY FULL (rows matched on all old values, one row at a time — a
duplicate row is changed once, as PostgreSQL's apply worker does, addressed by
``(tableoid, ctid)``), conflicts under ``skip``/``upsert`` (whose outcome depends on order),
a batch that is inconsistent with itself, a constraint violation in the set-based merge.
Each change is judged against the target as it is at that moment, like native apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.batch import (
    ApplyBatch,
    ApplyConflict,
    ConflictPolicy,
    TableCounts,
    TableStopped,
)
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.fetchmarks import MarkBook, TableMarks, column_names, read_again, write_read
from pgsieve.apply.net_effect import mask_positions
from pgsieve.apply.plan import BatchPlan, RowChange, TablePlan, table_changes
from pgsieve.apply.target import TargetWriter
from pgsieve.wire.messages import UNCHANGED


def _text(v: Any) -> str | None:
    return v.decode() if type(v) is bytes else None


def fetch_unchanged(writer: TargetWriter, source: tuple[str, str], source_table: str,
                    key_names: Sequence[str], keys: Sequence[tuple[bytes, ...]],
                    columns: Sequence[str], commit_lsn: Any, target: TargetTable
                    ) -> tuple[dict[tuple[bytes, ...], tuple[bytes | None, ...]], int]:
    """Values of unchanged-TOAST columns the stream did not carry, read from the source by
    key, and the source position they were read at: :mod:`.fetchmarks` marks them until
    the stream passes it. A row the source no longer holds gets NULL there, as a
    placeholder: it left the key before that position, so the stream deletes or moves
    it (reading the values again at its new key) before it passes the mark.
    :class:`TableStopped` when that is impossible: no source connection, the source
    unreachable, a placeholder for a column the target declares NOT NULL (see
    docs/guarantees.md, "Guarantees beyond native")."""
    why = None
    found: dict[tuple[bytes, ...], tuple[bytes | None, ...]] = {}
    position = 0
    if writer.source_dsn is None:
        why = "no source connection is configured to read them from"
    else:
        try:
            found, position = writer.fetch_source_rows(source, key_names, keys, columns)
        except psycopg.Error as exc:
            why = f"reading them from the source failed ({type(exc).__name__})"
        else:
            missing = [k for k in keys if k not in found]
            required = [c for c in columns if target.columns[target.index[c]].not_null]
            if missing and required:
                why = (f"the source no longer has the row with key "
                       f"{dict(zip(key_names, [v.decode() for v in missing[0]], strict=True))} "
                       f"(deleted or re-keyed since), and the target's {', '.join(required)} "
                       "cannot hold NULL until the stream deletes or moves it")
            placeholder = (None,) * len(columns)
            for k in missing:
                found[k] = placeholder
    if why is not None:
        raise TableStopped(
            source_table, commit_lsn,
            f"an UPDATE that the row filter turned into an INSERT did not carry the "
            f"unchanged TOAST column(s) {', '.join(columns)}; {why}. pgsieve never keeps a "
            "value it did not receive (native PostgreSQL would write NULL): resynchronise "
            "the table or skip the transaction")
    return found, position


class _RowApplier:
    def __init__(self, conn: psycopg.Connection[Any], writer: TargetWriter, tp: TablePlan,
                 policy: ConflictPolicy, counts: dict[str, TableCounts],
                 book: MarkBook | None) -> None:
        self.conn = conn
        self.writer = writer
        self.table: TargetTable = tp.target
        self.tp = tp
        self.policy = policy
        self.counts = counts
        self.book = book
        self.marks: TableMarks | None = None
        """The table's rows holding values read ahead of the stream (:mod:`.fetchmarks`),
        kept change by change."""
        if book is not None:
            self.marks = book.table(tp.target.qualified_name)
        self.ident = sql.Identifier(tp.target.schema, tp.target.name)
        self.key_names: list[str] = []
        """Key columns of the change being applied (its relation's, see RowChange.mode)."""
        self.written = 0

    # -- helpers -----------------------------------------------------------------------
    def _key_tuple(self, key: Any) -> tuple[Any, ...]:
        return (key,) if len(self.key_names) == 1 else tuple(key)

    def _key_where(self, key: Any) -> tuple[sql.Composable, list[Any]]:
        parts = [sql.SQL("{} = %s").format(sql.Identifier(n)) for n in self.key_names]
        return sql.SQL(" AND ").join(parts), [_text(v) for v in self._key_tuple(key)]

    def _key_dict(self, key: Any) -> dict[str, Any]:
        return dict(zip(self.key_names, [_text(v) for v in self._key_tuple(key)], strict=True))

    def _conflict(self, rc: RowChange, kind: str, key: dict[str, Any], detail: str,
                  missing: bool = False) -> None:
        """A change that does not fit the target. ``missing``: the row an UPDATE or DELETE
        is for is not there — policy ``native`` skips it and counts it, as PostgreSQL's
        apply worker does (everything else under ``native`` stops, as there)."""
        if self.policy == "error" or (self.policy == "native" and not missing):
            raise ApplyConflict(rc.source_table, kind, key, rc.commit_lsn, detail)
        counts = self.counts.get(rc.source_table)
        if counts is None:
            counts = self.counts[rc.source_table] = TableCounts()
        if self.policy == "native":
            counts.skip_missing(kind, key, rc.commit_lsn)
        else:
            counts.conflicts += 1

    def _exists(self, key: Any) -> bool:
        where, params = self._key_where(key)
        return self.conn.execute(sql.SQL("SELECT 1 FROM {} WHERE {} LIMIT 1").format(
            self.ident, where), params).fetchone() is not None

    def _full_row(self, rc: RowChange, key: Any) -> tuple[list[int], list[Any]]:
        """Positions and values to INSERT for ``rc``'s new row, unchanged TOAST included."""
        assert rc.row is not None
        positions = list(mask_positions(rc.mask))
        values: list[Any] = [rc.row[j] for j in positions]
        if rc.umask:
            ucols = list(mask_positions(rc.umask))
            if not self.key_names:
                raise TableStopped(rc.source_table, rc.commit_lsn,
                                   "unchanged TOAST values in a table without a key")
            kt = self._key_tuple(key)
            names = [self.table.columns[j].name for j in ucols]
            found, position = fetch_unchanged(self.writer, rc.relation_name, rc.source_table,
                                              self.key_names, [kt], names, rc.commit_lsn,
                                              self.table)
            positions += ucols
            values += list(found[kt])
            if self.book is not None:
                self.book.rows_read += 1
            if self.marks is not None:
                self.marks[key] = (frozenset(names), position)
        elif self.marks is not None and key is not None:
            self.marks.pop(key, None)
        return positions, values

    def _received(self, rc: RowChange, key: Any) -> None:
        """The row at ``key`` received ``rc``'s columns in place: they are no longer the
        ones read ahead of the stream."""
        if self.marks is None or key not in self.marks:
            return
        columns, position = self.marks[key]
        kept = columns - column_names(self.table, rc.mask)
        if kept:
            self.marks[key] = (kept, position)
        else:
            del self.marks[key]

    def _moved(self, rc: RowChange) -> None:
        """The row at ``rc.old_key`` moved to ``rc.key`` keeping the columns it did not
        receive: marked ones are read again at the new key (:mod:`.fetchmarks`)."""
        if self.marks is None:
            return
        mark = self.marks.pop(rc.old_key, None)
        self.marks.pop(rc.key, None)
        if mark is None:
            return
        kept = mark[0] - column_names(self.table, rc.mask)
        if not kept:
            return
        names = sorted(kept)
        found, position = read_again(self.writer, [rc.relation_name], rc.source_table,
                                     self.key_names, [rc.key], names)
        write_read(self.conn, self.table, rc.key_positions, names, found)
        self.marks[rc.key] = (kept, position)
        if self.book is not None:
            self.book.rows_read += len(found)

    def _insert(self, positions: Sequence[int], values: Sequence[Any]) -> None:
        cols = sql.SQL(", ").join(sql.Identifier(self.table.columns[j].name)
                                  for j in positions)
        if positions:
            stmt = sql.SQL("INSERT INTO {} ({}) OVERRIDING SYSTEM VALUE VALUES ({})").format(
                self.ident, cols, sql.SQL(", ").join([sql.Placeholder()] * len(positions)))
        else:
            stmt = sql.SQL("INSERT INTO {} DEFAULT VALUES").format(self.ident)
        self.conn.execute(stmt, [_text(v) for v in values])
        self.written += 1

    def _set(self, rc: RowChange, include_keys: bool) -> tuple[sql.Composable | None, list[Any]]:
        assert rc.row is not None
        keyset = set(rc.key_positions)
        positions = [j for j in mask_positions(rc.mask) if include_keys or j not in keyset]
        if not positions:
            return None, []
        sets = sql.SQL(", ").join(
            sql.SQL("{} = %s").format(sql.Identifier(self.table.columns[j].name))
            for j in positions)
        return sets, [_text(rc.row[j]) for j in positions]

    # -- keyed tables ------------------------------------------------------------------
    def apply(self, rc: RowChange) -> None:
        self.key_names = [self.table.columns[p].name for p in rc.key_positions]
        if rc.mode == "full":
            self._apply_full(rc)
        elif rc.mode == "keyless":
            self._apply_keyless(rc)
        elif rc.kind == "insert":
            self._insert_keyed(rc)
        elif rc.kind == "update":
            self._update_keyed(rc)
        else:
            self._delete_keyed(rc)

    def _insert_keyed(self, rc: RowChange) -> None:
        if self._exists(rc.key):
            self._conflict(rc, "insert", self._key_dict(rc.key),
                           "the row to insert already exists in the target")
            if self.policy == "upsert":
                sets, params = self._set(rc, include_keys=False)
                if sets is not None:
                    where, kparams = self._key_where(rc.key)
                    self.conn.execute(sql.SQL("UPDATE {} SET {} WHERE {}").format(
                        self.ident, sets, where), params + kparams)
                    self.written += 1
                    self._received(rc, rc.key)
            return
        self._insert(*self._full_row(rc, rc.key))

    def _update_keyed(self, rc: RowChange) -> None:
        key_changed = rc.old_key != rc.key
        if key_changed and self._exists(rc.key):
            self._conflict(rc, "update", self._key_dict(rc.key),
                           "an UPDATE changes the key to one that already exists in the target")
            if self.policy != "upsert":
                return
            where, params = self._key_where(rc.key)
            self.conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(self.ident, where),
                              params)
        sets, params = self._set(rc, include_keys=key_changed)
        where, kparams = self._key_where(rc.old_key)
        if sets is None:
            found = self._exists(rc.old_key)
        else:
            cur = self.conn.execute(sql.SQL("UPDATE {} SET {} WHERE {}").format(
                self.ident, sets, where), params + kparams)
            found = cur.rowcount > 0
            self.written += max(cur.rowcount, 0)
        if found:
            if key_changed:
                self._moved(rc)
            else:
                self._received(rc, rc.key)
            return
        self._conflict(rc, "update", self._key_dict(rc.old_key),
                       "the row to update is missing in the target", missing=True)
        if self.policy == "upsert":
            self._insert(*self._full_row(rc, rc.key))

    def _delete_keyed(self, rc: RowChange) -> None:
        where, params = self._key_where(rc.old_key)
        cur = self.conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(self.ident, where),
                                params)
        if cur.rowcount > 0:
            self.written += cur.rowcount
            if self.marks is not None:
                self.marks.pop(rc.old_key, None)
            return
        self._conflict(rc, "delete", self._key_dict(rc.old_key),
                       "the row to delete is missing in the target", missing=True)

    # -- tables without a key ------------------------------------------------------------
    def _apply_keyless(self, rc: RowChange) -> None:
        if rc.kind != "insert":
            raise TableStopped(rc.source_table, rc.commit_lsn,
                               f"an {rc.kind.upper()} arrived for a table without a replica "
                               "identity key: the row cannot be found")
        positions, values = self._full_row(rc, None)
        if self.policy in ("error", "native"):
            self._insert(positions, values)
            return
        try:
            with self.conn.transaction():
                self._insert(positions, values)
        except psycopg.errors.UniqueViolation as exc:
            detail = exc.diag.message_primary or "unique violation"
            self._conflict(rc, "insert", {}, f"the row to insert already exists ({detail})")

    def _match_old(self, rc: RowChange) -> tuple[sql.Composable, list[Any]]:
        """``(tableoid, ctid)`` of ONE row equal to the old row (REPLICA IDENTITY FULL)."""
        assert rc.old_row is not None
        conds: list[sql.Composable] = []
        params: list[Any] = []
        for j in mask_positions(rc.old_mask):
            col = self.table.columns[j]
            v = rc.old_row[j]
            ident = sql.Identifier(col.name)
            if v is None:
                conds.append(sql.SQL("{} IS NULL").format(ident))
                continue
            if col.has_equality:
                conds.append(sql.SQL("{} = %s").format(ident))
            else:  # json, xml, point…: no equality operator; compare the text forms
                conds.append(sql.SQL("{}::text = %s").format(ident))
            params.append(_text(v))
        where = sql.SQL(" AND ").join(conds) if conds else sql.SQL("true")
        return sql.SQL(
            "(tableoid, ctid) = (SELECT tableoid, ctid FROM {} WHERE {} LIMIT 1)").format(
            self.ident, where), params

    def _old_dict(self, rc: RowChange) -> dict[str, Any]:
        assert rc.old_row is not None
        return {self.table.columns[j].name: _text(rc.old_row[j])
                for j in mask_positions(rc.old_mask)}

    def _apply_full(self, rc: RowChange) -> None:
        if rc.kind == "insert":
            self._insert(*self._full_row(rc, None))
            return
        where, params = self._match_old(rc)
        if rc.kind == "delete":
            cur = self.conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(self.ident, where),
                                    params)
        else:
            sets, sparams = self._set(rc, include_keys=True)
            if sets is None:
                return
            cur = self.conn.execute(sql.SQL("UPDATE {} SET {} WHERE {}").format(
                self.ident, sets, where), sparams + params)
        if cur.rowcount > 0:
            self.written += cur.rowcount
            return
        self._conflict(rc, rc.kind, self._old_dict(rc),
                       f"no row in the target equals the old row to {rc.kind}", missing=True)
        if rc.kind == "update" and self.policy == "upsert":
            self._insert(*self._full_row(rc, None))


def apply_sequential(
    conn: psycopg.Connection[Any],
    writer: TargetWriter,
    batch: ApplyBatch,
    plan: BatchPlan,
    tp: TablePlan,
    policy: ConflictPolicy,
    counts: dict[str, TableCounts],
    marks: MarkBook | None = None,
) -> int:
    """Apply ``tp``'s changes one by one; returns rows written. ``marks``: the batch's
    (:mod:`.fetchmarks`; None outside a merge's transaction)."""
    applier = _RowApplier(conn, writer, tp, policy, counts, marks)
    for rc in table_changes(batch, plan, tp):
        if rc.row is not None and any(rc.row[j] is UNCHANGED for j in mask_positions(rc.mask)):
            raise AssertionError("a received column holds no value")  # pragma: no cover
        applier.apply(rc)
    return applier.written
