"""Rows holding values read from the source ahead of the stream, until the stream catches
up with the read: where a later key change must read them again.

Why: an UPDATE that a row filter turned into an INSERT carries its unchanged TOAST columns
as ``'u'``; pgsieve reads them from the source by key (:func:`.driver.fetch_pending`).
That read sees the source *now*, later than the change. If by then the row has moved on
to a new key and another row has taken the first key, the read returns the newcomer's
value — and the stream's next change of the row, a key change with that column still
``'u'``, would carry the wrong value to the row's new key for good.

So each read value is **marked**: (target table, key) → the columns read and the source's
WAL position right after the read (every transaction the read saw ends at or before it).
While a mark stands, in commit order:

- a key change from the marked key reads the columns it did not receive **again**, at the
  new key, and the mark moves there with the new read's position (a row already gone
  from the new key keeps the carried value: its leaving is then in the stream, before
  that position, and is met with the mark's help in turn);
- an UPDATE in place that receives a marked column clears it; a DELETE, or another row
  taking the key, drops the mark; a TRUNCATE drops the table's marks;
- a batch ending at or past the mark's position drops it: every transaction the read saw
  is applied then, so the row the stream holds at the key is the one the read saw, and
  any later change to the column arrives in full.

Marks live in the target (``pgsieve.fetched``), written in the batch's transaction, so a
restart keeps them; each writer caches its subscription's (none, nearly always: they
live from a read until the stream passes it, a batch or two). While any stands, batches
take the merge's transaction rather than the one-round-trip script.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from pgsieve.apply.batch import TableStopped
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.net_effect import (
    MASK,
    OP_ABSENT,
    OP_DELETE,
    OP_UPDATE,
    ORIGIN,
    ROW,
    Key,
    mask_positions,
)
from pgsieve.apply.plan import BatchPlan, TablePlan
from pgsieve.apply.staging import SCHEMA
from pgsieve.wire.lsn import Lsn

if TYPE_CHECKING:  # (the writer holds a FetchMarks: no import back at run time)
    from pgsieve.apply.target import TargetWriter

FETCHED_TABLE = "fetched"
FETCHED_DDL = f"""
CREATE TABLE IF NOT EXISTS {SCHEMA}.{FETCHED_TABLE} (
    subscription_id text NOT NULL,
    target_table text NOT NULL,
    key text[] NOT NULL,
    columns text[] NOT NULL,
    source_lsn pg_lsn NOT NULL,
    PRIMARY KEY (subscription_id, target_table, key)
);
COMMENT ON TABLE {SCHEMA}.{FETCHED_TABLE} IS
    'pgsieve: rows whose unchanged TOAST values were read from the source ahead of the stream';
"""

Mark = tuple[frozenset[str], int]
"""The columns read (names) and the source position after the read (an LSN value)."""

TableMarks = dict[Key, Mark]


def key_text(key: Key) -> list[str]:
    """A net-effect key (text bytes, or a tuple of them) as the stored ``text[]``."""
    parts = key if type(key) is tuple else (key,)
    return [v.decode() for v in parts]


def key_of_text(values: Sequence[str]) -> Key:
    parts = tuple(v.encode() for v in values)
    return parts[0] if len(parts) == 1 else parts


def column_names(target: TargetTable, mask: int) -> frozenset[str]:
    return frozenset(target.columns[j].name for j in mask_positions(mask))


def column_mask(target: TargetTable, names: Iterable[str]) -> int:
    """Bits of ``names`` in ``target`` (a column dropped since counts no more)."""
    mask = 0
    for n in names:
        j = target.index.get(n)
        if j is not None:
            mask |= 1 << j
    return mask


class FetchMarks:
    """The subscription's committed marks, as the target holds them (a cache, read on
    first use and again after a merge that may or may not have committed). One per
    subscription's writers (:class:`~pgsieve.apply.mergebehind.MergeBehind`'s two
    share it); only the thread that merges touches it."""

    def __init__(self, subscription_id: str) -> None:
        self.subscription_id = subscription_id
        self._tables: dict[str, TableMarks] | None = None

    def loaded(self, conn: psycopg.Connection[Any]) -> dict[str, TableMarks]:
        if self._tables is None:
            tables: dict[str, TableMarks] = {}
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                  (f"{SCHEMA}.{FETCHED_TABLE}",)).fetchone()
            if exists and exists[0]:
                for table, key, columns, lsn in conn.execute(
                        f"SELECT target_table, key, columns, source_lsn::text "
                        f"FROM {SCHEMA}.{FETCHED_TABLE} WHERE subscription_id = %s",
                        (self.subscription_id,)):
                    tables.setdefault(table, {})[key_of_text(key)] = (
                        frozenset(columns), Lsn.parse(lsn).value)
            self._tables = tables
        return self._tables

    def invalidate(self) -> None:
        """Read them again on next use (a merge failed: its COMMIT may have happened)."""
        self._tables = None

    def committed(self, tables: dict[str, TableMarks]) -> None:
        """The merge that wrote ``tables`` (each whole, as the target now holds it)
        committed."""
        if self._tables is None:
            return
        for name, marks in tables.items():
            if marks:
                self._tables[name] = marks
            else:
                self._tables.pop(name, None)

    def hand_over(self, conn: psycopg.Connection[Any], subscription_id: str) -> None:
        """Give these marks to ``subscription_id`` (``conn`` in autocommit): a table's
        catch-up hands its values read ahead over to the subscription's stream, which
        applies the table's changes from then on (it reads them again once its routes
        change)."""
        with conn.transaction():
            conn.execute(
                f"INSERT INTO {SCHEMA}.{FETCHED_TABLE} AS f "
                "(subscription_id, target_table, key, columns, source_lsn) "
                f"SELECT %s, target_table, key, columns, source_lsn FROM {SCHEMA}.{FETCHED_TABLE} "
                "WHERE subscription_id = %s "
                "ON CONFLICT (subscription_id, target_table, key) DO UPDATE "
                "SET columns = excluded.columns, source_lsn = excluded.source_lsn",
                (subscription_id, self.subscription_id))
            conn.execute(
                f"DELETE FROM {SCHEMA}.{FETCHED_TABLE} WHERE subscription_id = %s",
                (self.subscription_id,))
        self.invalidate()


class MarkBook:
    """One merge attempt's marks: copies of the committed ones it changes, written in its
    transaction (:meth:`flush`) and handed to the cache once it committed."""

    def __init__(self, marks: FetchMarks, conn: psycopg.Connection[Any]) -> None:
        self._marks = marks
        self._committed = marks.loaded(conn)
        self._working: dict[str, TableMarks] = {}
        self._staged: dict[str, list[tuple[Key, Key | None, int]]] = {}
        self.rows_read = 0
        """Rows the transaction read from the source: read again at a new key, or (change
        by change) read for an UPDATE turned into an INSERT."""

    @staticmethod
    def needed(marks: FetchMarks, conn: psycopg.Connection[Any], plan: BatchPlan) -> bool:
        """Whether a batch has marks to read, move, make or drop."""
        return bool(marks.loaded(conn)) or any(tp.fetched for tp in plan.tables.values())

    def table(self, name: str) -> TableMarks:
        """The working marks of one table (changed in place by the caller)."""
        marks = self._working.get(name)
        if marks is None:
            marks = self._working[name] = dict(self._committed.get(name, {}))
        return marks

    def truncated(self, names: Iterable[str]) -> None:
        for name in names:
            self._working[name] = {}

    # -- set-based tables ----------------------------------------------------------------
    def before_merge(self, conn: psycopg.Connection[Any], plan: BatchPlan,
                     staged: dict[str, str]) -> None:
        """Tables planned by Spark tasks (no entries here) with marks: their staged rows
        at or from a marked key, read before the merge fills moved rows' kept columns in
        the staging table (``staged``: staging table by target table)."""
        for name, tp in plan.tables.items():
            marks = self._committed.get(name)
            staging = staged.get(name)
            if marks and staging is not None and not tp.effect.entries:
                self._staged[name] = list(_staged_records(conn, tp, staging, marks))

    def settle(self, conn: psycopg.Connection[Any], writer: TargetWriter, plan: BatchPlan,
               name: str, tp: TablePlan) -> None:
        """A table merged set-based: its marks after the batch; moved rows' marked
        columns read again and written."""
        before = self._working.get(name, self._committed.get(name))
        if not before and not tp.fetched:
            return
        marks = self.table(name)
        target = tp.target
        for key, (mask, lsn) in tp.fetched.items():
            marks[key] = (column_names(target, mask), lsn)
        if not before:
            return
        moved: list[tuple[Key, frozenset[str]]] = []
        records = self._staged.get(name)
        if records is None:
            records = list(_records(tp))
        for key, origin, received in records:
            if key in tp.fetched:
                continue
            mark = None if origin is None else before.get(origin)
            kept = None if mark is None else mark[0] - column_names(target, received)
            if not kept:
                marks.pop(key, None)
            elif origin == key:
                marks[key] = (kept, mark[1])  # type: ignore[index]
            else:
                moved.append((key, kept))
        self._read_again(conn, writer, plan, tp, marks, moved)

    def _read_again(self, conn: psycopg.Connection[Any], writer: TargetWriter,
                    plan: BatchPlan, tp: TablePlan, marks: TableMarks,
                    moved: list[tuple[Key, frozenset[str]]]) -> None:
        groups: dict[frozenset[str], list[Key]] = {}
        for key, columns in moved:
            groups.setdefault(columns, []).append(key)
        sources = sorted({(rm.relation.namespace, rm.relation.name)
                          for rm in plan.relation_maps.values()
                          if rm.target.qualified_name == tp.target.qualified_name})
        for columns, keys in groups.items():
            names = sorted(columns)
            found, position = read_again(
                writer, sources, tp.source_table,
                [tp.target.columns[p].name for p in tp.key_positions or ()], keys, names)
            write_read(conn, tp.target, tp.key_positions or (), names, found)
            self.rows_read += len(found)
            for key in keys:
                marks[key] = (columns, position)

    # -- the transaction -----------------------------------------------------------------
    def flush(self, conn: psycopg.Connection[Any], end_lsn: Lsn) -> None:
        """Write the marks that changed, and drop every mark the batch's end passed (see
        the module doc), in the batch's transaction."""
        for name in self._committed:
            self.table(name)
        gone: list[tuple[str, str, list[str]]] = []
        made: list[tuple[str, str, list[str], list[str], str]] = []
        sub = self._marks.subscription_id
        for name, marks in self._working.items():
            for key in [k for k, (_, lsn) in marks.items() if lsn <= end_lsn.value]:
                del marks[key]
            old = self._committed.get(name, {})
            for key, mark in old.items():
                if marks.get(key) != mark:
                    gone.append((sub, name, key_text(key)))
            for key, mark in marks.items():
                if old.get(key) != mark:
                    made.append((sub, name, key_text(key), sorted(mark[0]),
                                 str(Lsn(mark[1]))))
        with conn.cursor() as cur:
            if gone:
                cur.executemany(
                    f"DELETE FROM {SCHEMA}.{FETCHED_TABLE} WHERE subscription_id = %s "
                    "AND target_table = %s AND key = %s", gone)
            if made:
                cur.executemany(
                    f"INSERT INTO {SCHEMA}.{FETCHED_TABLE} "
                    "(subscription_id, target_table, key, columns, source_lsn) "
                    "VALUES (%s, %s, %s, %s, %s::pg_lsn) "
                    "ON CONFLICT (subscription_id, target_table, key) DO UPDATE "
                    "SET columns = excluded.columns, source_lsn = excluded.source_lsn", made)

    def commit(self) -> None:
        """The batch's transaction committed."""
        self._marks.committed(self._working)


def _records(tp: TablePlan) -> Iterator[tuple[Key, Key | None, int]]:
    """``(key, origin, received columns)`` of the table's keys after the batch, from its
    net effect. Keys the batch deleted or left have no row: origin None and nothing
    received, which drops their marks."""
    for key, e in tp.effect.entries.items():
        if e[ROW] is None:
            yield key, None, 0
        else:
            yield key, e[ORIGIN], e[MASK]


def _staged_records(conn: psycopg.Connection[Any], tp: TablePlan, staging: str,
                    marks: TableMarks) -> Iterator[tuple[Key, Key | None, int]]:
    """:func:`_records` of the staged rows at or from a marked key."""
    kp = tp.key_positions or ()
    keys = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(f"c{p}"))
                              for p in kp)
    origins = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(f"o{i}"))
                                 for i in range(len(kp)))
    wanted = [json.dumps(key_text(k)) for k in marks]
    query = sql.SQL(
        "SELECT _op, _m, ARRAY[{keys}], ARRAY[{origins}] FROM {stage} "
        "WHERE to_jsonb(ARRAY[{keys}]) = ANY(%s::text[]::jsonb[]) "
        "OR to_jsonb(ARRAY[{origins}]) = ANY(%s::text[]::jsonb[])"
    ).format(keys=keys, origins=origins, stage=sql.Identifier(SCHEMA, staging))
    for op, m, key, origin in conn.execute(query, (wanted, wanted)):
        k = key_of_text(key)
        if op in (OP_DELETE, OP_ABSENT):
            yield k, None, 0
            continue
        received = sum(1 << j for j, c in enumerate(m or "") if c == "1")
        if op == OP_UPDATE:
            yield k, k, received
        elif origin[0] is not None:
            yield k, key_of_text(origin), received
        else:
            yield k, None, received


def read_again(writer: TargetWriter, sources: Sequence[tuple[str, str]], source_table: str,
               key_names: Sequence[str], keys: Sequence[Key], columns: Sequence[str]
               ) -> tuple[dict[tuple[bytes, ...], tuple[bytes | None, ...]], int]:
    """Marked columns of moved rows, read from the source at their new keys (any of the
    source tables routed here); keys the source no longer holds are left out. The
    position is read after the last source's rows."""
    wanted = [k if type(k) is tuple else (k,) for k in keys]
    found: dict[tuple[bytes, ...], tuple[bytes | None, ...]] = {}
    position = 0
    try:
        for source in sources:
            rows, position = writer.fetch_source_rows(
                source, key_names, [k for k in wanted if k not in found], columns)
            found.update(rows)
    except psycopg.Error as exc:
        raise TableStopped(
            source_table, Lsn(0),
            f"a row whose unchanged TOAST column(s) {', '.join(columns)} were read from the "
            f"source moved to a new key; reading them again there failed "
            f"({type(exc).__name__})") from None
    return found, position


def write_read(conn: psycopg.Connection[Any], target: TargetTable,
               key_positions: Sequence[int], columns: Sequence[str],
               found: dict[tuple[bytes, ...], tuple[bytes | None, ...]]) -> None:
    """Set ``columns`` of the target rows with these keys to the values read."""
    if not found:
        return
    sets = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in columns)
    where = sql.SQL(" AND ").join(sql.SQL("{} = %s").format(
        sql.Identifier(target.columns[p].name)) for p in key_positions)
    stmt = sql.SQL("UPDATE {} SET {} WHERE {}").format(
        sql.Identifier(target.schema, target.name), sets, where)
    rows = [[None if v is None else v.decode() for v in values]
            + [v.decode() for v in key] for key, values in found.items()]
    with conn.cursor() as cur:
        cur.executemany(stmt, rows)
