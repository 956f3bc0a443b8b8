"""New tables in a running subscription's publications, followed under ``schema_changes:
follow`` (issue 57) by a real ``pgsieve worker`` and ``pgsieve beat`` on Redis, against a
native subscriber of the same publications:

* a table created at the source in a ``FOR TABLES IN SCHEMA`` publication, with rows
  written before, during and after its copy: the stream meets its changes, the table is
  created at the target (its primary key and NOT NULLs) and copied, then streamed;
* a table added through the API to a publication with a ``where`` filter (a ``FOR TABLES IN
  SCHEMA`` publication has no row filter syntax, and a filter on a table it also covers
  is not used, in PostgreSQL 15 — docs/differences-from-native.md): followed right after the
  PATCH, copied and streamed under the filter, rows crossing the filter included;
* an empty table created in the schema: beat's check follows it;
* a subscription under ``stop``: nothing is created, its refresh answers the DDL.

Native gets none of these tables until each is created by hand and ``ALTER
SUBSCRIPTION … REFRESH PUBLICATION`` runs (until the table exists its apply worker stops
on the new table's rows); then both targets are identical. One
deployment for all of it."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.conftest import Database
from tests.integration.pipeline_env import (
    PipelineEnv,
    applied_past,
    native_subscription,
    pipeline_env,
    source_lsn,
    table_rows,
    wait_until,
)

pytestmark = pytest.mark.spark

SCHEMA = """
CREATE SCHEMA app;
CREATE TABLE app.base (id int PRIMARY KEY, v text);
CREATE TABLE public.orders (id int PRIMARY KEY, region text NOT NULL);
CREATE SCHEMA other;
CREATE TABLE other.keep (id int PRIMARY KEY);
"""
NEWT = "CREATE TABLE app.newt (id int PRIMARY KEY, name text NOT NULL, note text)"
FRESH = "CREATE TABLE public.fresh (id int PRIMARY KEY, n int NOT NULL, label text)"


class Writes(threading.Thread):
    """Single-row inserts and updates into one table until stopped (updates move rows
    across ``n % 2 = 0``, the API table's filter)."""

    def __init__(self, dsn: str, table: str, first: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.table, self.next = dsn, table, first
        self.first = first
        self.stop = threading.Event()
        self.rnd = random.Random(57)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    self.one(conn)
                    time.sleep(0.01)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def one(self, conn: psycopg.Connection[object]) -> None:
        key = self.next
        self.next += 1
        if self.table == "app.newt":
            conn.execute("INSERT INTO app.newt VALUES (%s, %s, NULL)", (key, f"n{key}"))
            conn.execute("UPDATE app.newt SET note = 'u' WHERE id = %s",
                         (self.rnd.randint(1, key),))
        else:
            conn.execute("INSERT INTO public.fresh VALUES (%s, %s, 'w')",
                         (key, self.rnd.randint(0, 9)))
            conn.execute("UPDATE public.fresh SET n = n + 1 WHERE id = %s",
                         (self.rnd.randint(1, key),))

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        assert self.error is None, self.error


def _state(env: PipelineEnv, sub_id: str, table: str) -> str | None:
    for t in env.subscription(sub_id)["tables"]:
        if t["table"] == table:
            return str(t["sync_state"])
    return None


def _exists(db: Database, table: str) -> bool:
    return bool(db.query("SELECT to_regclass(%s) IS NOT NULL", (table,))[0][0])


def _native_refresh(source: Database, native: Database, ddl: str) -> None:
    """What a person does natively: the table by hand, then REFRESH PUBLICATION (its
    copy under the publications' filters), waited for to be synced and caught up."""
    native.execute(ddl)
    native.execute("ALTER SUBSCRIPTION nat REFRESH PUBLICATION")
    wait_until(lambda: all(r[0] in ("r", "s") for r in native.query(
        "SELECT srsubstate FROM pg_subscription_rel")), 60, "native's table sync")
    lsn = source_lsn(source)
    wait_until(lambda: bool(native.query(
        "SELECT latest_end_lsn >= %s::pg_lsn FROM pg_stat_subscription WHERE relid IS NULL",
        (lsn,))[0][0]), 60, "native caught up")


def _applied_past(target: Database, lsn: str) -> bool:
    try:
        return applied_past(target, lsn)
    except psycopg.errors.UndefinedTable:  # no batch applied yet
        return False


def _caught_up(env: PipelineEnv, source: Database, target: Database) -> None:
    lsn = source_lsn(source)
    wait_until(lambda: _applied_past(target, lsn), 60, "pgsieve caught up", env)


def test_new_tables_are_created_copied_and_streamed_like_native_after_a_refresh(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    source_db.execute(SCHEMA + """
    ALTER TABLE public.orders REPLICA IDENTITY FULL;
    CREATE PUBLICATION pub_app FOR TABLES IN SCHEMA app;
    CREATE PUBLICATION pub_other FOR TABLES IN SCHEMA other;
    """)
    target_db.execute(SCHEMA)
    native_db.execute(SCHEMA)
    with pipeline_env(tmp_path) as env:
        source_id, target_id = env.register(source_db, target_db)
        env.api("POST", f"/sources/{source_id}/publications", json={
            "name": "pub_api", "tables": [{"table": "public.orders",
                                           "where": "region = 'eu'"}]})
        sub_id = env.api("POST", "/subscriptions", json={
            "name": "follow", "source_id": source_id, "target_id": target_id,
            "publications": ["pub_app", "pub_api"], "copy_data": False,
            "options": {"batch_max_wait_ms": 200}})["id"]
        stop_id = env.api("POST", "/subscriptions", json={
            "name": "stopper", "source_id": source_id, "target_id": target_id,
            "publications": ["pub_other"], "copy_data": False,
            "options": {"batch_max_wait_ms": 200, "schema_changes": "stop"}})["id"]
        native_subscription(source_db, native_db, "nat", ["pub_app", "pub_api"])
        env.start_worker()
        source_db.execute("INSERT INTO app.base VALUES (1, 'a'), (2, 'b');"
                          "INSERT INTO orders VALUES (1, 'eu'), (2, 'us')")
        _caught_up(env, source_db, target_db)

        # (b) CREATE TABLE under FOR TABLES IN SCHEMA: the stream meets its rows.
        source_db.execute(NEWT + ";" + "INSERT INTO app.newt SELECT g, 'n' || g, 'before' "
                          "FROM generate_series(1, 300) g;"
                          "CREATE TABLE other.t (id int PRIMARY KEY, v text NOT NULL);"
                          "INSERT INTO other.t VALUES (1, 'x')")
        writes = Writes(source_db.dsn, "app.newt", 301)
        writes.start()
        wait_until(lambda: _state(env, sub_id, "app.newt") == "ready", 90,
                   "app.newt followed: created, copied, handed over", env)
        writes.finish()
        source_db.execute("INSERT INTO app.newt VALUES (100000, 'after', NULL);"
                          "DELETE FROM app.newt WHERE id = 5")
        _caught_up(env, source_db, target_db)
        assert table_rows(target_db, "app.newt", "id") == table_rows(
            source_db, "app.newt", "id")
        assert target_db.query(
            "SELECT attname, attnotnull FROM pg_attribute WHERE attrelid = 'app.newt'::regclass"
            " AND attnum > 0 ORDER BY attnum") == [
            ("id", True), ("name", True), ("note", False)]
        assert target_db.query(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = 'app.newt'::regclass AND contype = 'p'") == [
            ("PRIMARY KEY (id)",)]
        assert not _exists(native_db, "app.newt"), "native has no such table"
        # ... and its apply worker stops on the new table's rows (every table waits).
        wait_until(lambda: native_db.query(
            "SELECT apply_error_count > 0 FROM pg_stat_subscription_stats "
            "WHERE subname = 'nat'") == [(True,)], 30, "native to stop on app.newt")
        assert native_db.query("SELECT count(*) FROM pg_subscription_rel sr JOIN pg_class c"
                               " ON c.oid = sr.srrelid WHERE c.relname = 'newt'") == [(0,)]

        # (a) A table added through pgsieve's API, with a row filter.
        source_db.execute(FRESH + "; ALTER TABLE public.fresh REPLICA IDENTITY FULL;"
                          "INSERT INTO public.fresh SELECT g, g % 10, 'before'"
                          " FROM generate_series(1, 400) g")
        fresh = Writes(source_db.dsn, "public.fresh", 401)
        fresh.start()
        env.api("PATCH", f"/sources/{source_id}/publications/pub_api", json={
            "tables": [{"table": "public.orders", "where": "region = 'eu'"},
                       {"table": "public.fresh", "where": "n % 2 = 0"}]})
        wait_until(lambda: _state(env, sub_id, "public.fresh") == "ready", 90,
                   "public.fresh followed after the PATCH", env)
        fresh.finish()
        source_db.execute("INSERT INTO public.fresh VALUES (100000, 2, 'after'), "
                          "(100001, 3, 'after'); UPDATE public.fresh SET n = 4 WHERE id = 1")
        _caught_up(env, source_db, target_db)
        filtered = source_db.query("SELECT * FROM public.fresh WHERE n % 2 = 0 ORDER BY id")
        assert table_rows(target_db, "public.fresh", "id") == filtered
        assert not _exists(native_db, "public.fresh")

        # Native: the tables by hand, then REFRESH PUBLICATION — then both are identical.
        _native_refresh(source_db, native_db, NEWT + ";" + FRESH)
        _caught_up(env, source_db, target_db)
        for table in ("app.base", "public.orders", "app.newt", "public.fresh"):
            assert table_rows(native_db, table, "id") == table_rows(target_db, table, "id"), table

        # (c) An empty table: nothing for the stream to meet; beat's check follows it.
        source_db.execute("CREATE TABLE app.empty (id bigint PRIMARY KEY, at timestamptz)")
        env.start_beat()
        wait_until(lambda: _state(env, sub_id, "app.empty") == "ready", 60,
                   "beat to follow the empty table", env)
        source_db.execute("INSERT INTO app.empty VALUES (1, now())")
        _caught_up(env, source_db, target_db)
        assert table_rows(target_db, "app.empty", "id") == table_rows(
            source_db, "app.empty", "id")

        # Recorded: one add_table per followed table.
        changes = env.api("GET", f"/subscriptions/{sub_id}/schema-changes")
        assert sorted((c["table"], c["change"], c["action"]) for c in changes) == [
            ("app.empty", "add_table", "applied"), ("app.newt", "add_table", "applied"),
            ("public.fresh", "add_table", "applied")]
        newt = next(c for c in changes if c["table"] == "app.newt")
        assert newt["after"]["primary_key"] == ["id"] and newt["before"] is None
        assert any(s.startswith('CREATE TABLE "app"."newt"') for s in newt["ddl"])

        # stop: the stream and beat passed other.t (a round after the worker's follow
        # of app.empty); nothing created, the refresh answers the DDL.
        assert _state(env, stop_id, "other.t") is None
        assert not _exists(target_db, "other.t")
        assert env.api("GET", f"/subscriptions/{stop_id}/schema-changes") == []
        r = env.client.post(f"/api/v1/subscriptions/{stop_id}/refresh")
        assert r.status_code == 422 and r.json()["code"] == "target_table_missing", r.text
        assert r.json()["ddl"][-1] == (
            'CREATE TABLE "other"."t" ("id" integer NOT NULL, "v" text NOT NULL, '
            'PRIMARY KEY ("id"))')
        assert not _exists(target_db, "other.t")
        assert env.subscription(sub_id)["state"] == "streaming"
        assert env.subscription(stop_id)["state"] == "streaming"
