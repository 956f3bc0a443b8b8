"""Capture golden pgoutput bytes from a real PostgreSQL server.

    .venv/bin/python -m tests.golden.capture            # rewrite tests/golden/*.json

Starts a throw-away LocalCluster (``logical_decoding_work_mem = 64kB`` so big transactions
stream, ``max_prepared_transactions`` > 0 for two-phase), and for each scenario: a fresh
database, the scenario's tables and publication ``p``, a pgoutput slot, the workload, then
``pg_logical_slot_peek_binary_changes`` with the scenario's options. Each scenario is
written to ``<name>.json``: options, server version, workload notes, and every message as
``{"lsn", "xid", "data": hex}``.

The same :data:`SCENARIOS` and :func:`capture` run live in
tests/integration/test_pgoutput_golden.py, so the committed bytes are re-checked against
the real server on every test run.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from pgsieve.platform.pgcluster import LocalCluster, free_port

GOLDEN_DIR = Path(__file__).resolve().parent
CLUSTER_SETTINGS = {
    "logical_decoding_work_mem": "64kB",
    "max_prepared_transactions": "10",
    "fsync": "off",
    "synchronous_commit": "off",
}

Notes = dict[str, Any]
Drain = Callable[[], None]


@dataclass(frozen=True)
class Scenario:
    name: str
    proto_version: int
    setup: str  # DDL, run before the slot exists
    # Gets the database DSN and a ``drain()`` that consumes what the slot has decoded so
    # far (to capture an in-progress transaction); returns notes for the checks.
    workload: Callable[[str, Callable[[], None]], Notes]
    options: tuple[tuple[str, str], ...] = ()
    two_phase: bool = False  # slot created with two-phase decoding (needs prepared xacts)


def _connect(dsn: str, autocommit: bool = False) -> psycopg.Connection[tuple[Any, ...]]:
    """Synchronous commit: with it off (as the test clusters run), a commit may not be
    flushed yet when we peek, and peeking only decodes flushed WAL."""
    return psycopg.connect(dsn, autocommit=autocommit, options="-c synchronous_commit=on")


def _run(dsn: str, *statements: str) -> None:
    with _connect(dsn, autocommit=True) as conn:
        for sql in statements:
            conn.execute(sql.encode())


def flush_wal(dsn: str) -> None:
    """Make all WAL written so far visible to decoding (it reads only flushed WAL): commit
    a transaction that writes WAL, synchronously. (An xid alone is not enough: a commit
    that wrote no WAL is never flushed synchronously.)"""
    _run(dsn, "CREATE TEMP TABLE flush_barrier (x int)")


def _txn(dsn: str, *statements: str) -> None:
    with _connect(dsn) as conn:  # one transaction, committed on exit
        for sql in statements:
            conn.execute(sql.encode())


# -- workloads ---------------------------------------------------------------------------------
def _basic(dsn: str, drain: Drain) -> Notes:
    _run(
        dsn,
        "INSERT INTO items VALUES (1, 'apple', 1.50, '2024-01-02 03:04:05.123456+00', true),"
        " (2, 'pear', NULL, NULL, false), (3, 'plum ünïcode', 99999999.99,"
        " '1999-12-31 23:59:59+00', NULL)",
        "UPDATE items SET price = 2.25, name = 'green apple' WHERE id = 1",
        "DELETE FROM items WHERE id = 2",
    )
    return {}


def _key_update(dsn: str, drain: Drain) -> Notes:
    _run(dsn, "INSERT INTO kv VALUES (1, 'a')", "UPDATE kv SET k = 10 WHERE k = 1")
    return {}


def _replica_identity(dsn: str, drain: Drain) -> Notes:
    _txn(
        dsn,
        "INSERT INTO ri_default VALUES (1, 'a')",
        "INSERT INTO ri_index VALUES (1, 'c1', 'a')",
        "INSERT INTO ri_full VALUES (1, 'a')",
        "INSERT INTO ri_nothing VALUES (1, 'a')",
    )
    _run(
        dsn,
        "UPDATE ri_default SET v = 'b'",
        "UPDATE ri_index SET v = 'b'",
        "UPDATE ri_index SET code = 'c2'",
        "UPDATE ri_full SET v = 'b'",
        "DELETE FROM ri_default",
        "DELETE FROM ri_index",
        "DELETE FROM ri_full",
    )
    try:
        _run(dsn, "UPDATE ri_nothing SET v = 'b'")
    except psycopg.Error as exc:
        return {"nothing_update_error": {"sqlstate": exc.sqlstate, "message": str(exc)}}
    return {"nothing_update_error": None}


def _toast(dsn: str, drain: Drain) -> Notes:
    _run(
        dsn,
        "INSERT INTO big SELECT 1, string_agg(md5(i::text), '' ORDER BY i), 0"
        " FROM generate_series(1, 400) i",
        "UPDATE big SET counter = 1 WHERE id = 1",
    )
    with _connect(dsn) as conn:
        row = conn.execute("SELECT md5(payload), length(payload) FROM big").fetchone()
    assert row is not None
    return {"payload_md5": row[0], "payload_length": row[1]}


def _binary(dsn: str, drain: Drain) -> Notes:
    _run(
        dsn,
        "INSERT INTO bin_types VALUES (1, true, -12.345, '2024-02-29 12:00:00.5+00',"
        " '\\x00ff10', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{\"k\": [1, 2]}',"
        " '{x,\"y z\",NULL}', NULL)",
    )
    return {}


def _messages(dsn: str, drain: Drain) -> Notes:
    _run(dsn, "SELECT pg_logical_emit_message(false, 'golden', 'outside')")
    _txn(
        dsn,
        "INSERT INTO msg_t VALUES (1)",
        "SELECT pg_logical_emit_message(true, 'golden', 'transactional')",
        "SELECT pg_logical_emit_message(false, 'golden', 'immediate')",
    )
    _txn(dsn, "SELECT pg_logical_emit_message(true, 'golden', '\\x00016263'::bytea)")
    return {}


def _truncate(dsn: str, drain: Drain) -> Notes:
    _run(
        dsn,
        "INSERT INTO parent VALUES (1), (2)",
        "INSERT INTO child VALUES (1, 1)",
        "INSERT INTO counter_t (v) VALUES ('a'), ('b')",
        "TRUNCATE parent CASCADE",
        "TRUNCATE counter_t RESTART IDENTITY",
    )
    return {}


def _types(dsn: str, drain: Drain) -> Notes:
    _run(dsn, "INSERT INTO typed VALUES (1, 'happy', ROW(7, 'x y'), '{sad,ok}')")
    return {}


def _origin(dsn: str, drain: Drain) -> Notes:
    _run(
        dsn,
        "SELECT pg_replication_origin_create('golden_origin') WHERE NOT EXISTS"
        " (SELECT 1 FROM pg_replication_origin WHERE roname = 'golden_origin')",
    )
    with _connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_origin_session_setup('golden_origin')")
        with conn.transaction():
            conn.execute(
                "SELECT pg_replication_origin_xact_setup('0/ABCDEF0', '2024-01-01 00:00:00+00')"
            )
            conn.execute("INSERT INTO orig_t VALUES (1)")
        conn.execute("SELECT pg_replication_origin_session_reset()")
    _run(dsn, "INSERT INTO orig_t VALUES (2)")
    return {"origin": "golden_origin", "origin_lsn": "0/ABCDEF0"}


def _big_insert(first: int, count: int) -> str:
    return (f"INSERT INTO s SELECT i, md5(i::text) || md5((-i)::text)"
            f" FROM generate_series({first}, {first + count - 1}) i")


def _stream_big(dsn: str, drain: Drain) -> Notes:
    _txn(dsn, _big_insert(1, 1000),
         "SELECT pg_logical_emit_message(true, 'golden', 'in stream')",
         _big_insert(1001, 200))
    _run(dsn, "INSERT INTO s VALUES (0, 'small')")  # an ordinary transaction after it
    return {"rows": 1200}


def _stream_subxact_abort(dsn: str, drain: Drain) -> Notes:
    _txn(dsn, _big_insert(1, 800), "SAVEPOINT sp", _big_insert(10001, 800),
         "ROLLBACK TO SAVEPOINT sp", _big_insert(20001, 10))
    return {"kept": [[1, 800], [20001, 10]], "aborted": [10001, 800]}


def _stream_abort(dsn: str, drain: Drain) -> Notes:
    with _connect(dsn) as conn:
        conn.execute(_big_insert(1, 1000).encode())
        drain()  # decoded while in progress: streamed (had it aborted, it would be skipped)
        conn.rollback()
    _run(dsn, "INSERT INTO s VALUES (0, 'after')")
    return {}


def _stream_interleaved(dsn: str, drain: Drain) -> Notes:
    with _connect(dsn) as a, _connect(dsn) as b:
        for step in range(4):
            a.execute(_big_insert(100_000 + step * 300, 300).encode())
            b.execute(_big_insert(200_000 + step * 300, 300).encode())
        b.commit()  # committed first although it started second
        a.commit()
    return {"first_commit_ids": [200_000, 1200], "second_commit_ids": [100_000, 1200]}


def _two_phase(dsn: str, drain: Drain) -> Notes:
    _run(dsn, "BEGIN", "INSERT INTO tp VALUES (1, 'one'), (2, 'two')",
         "PREPARE TRANSACTION 'golden_gx1'", "COMMIT PREPARED 'golden_gx1'",
         "BEGIN", "INSERT INTO tp VALUES (3, 'three')",
         "PREPARE TRANSACTION 'golden_gx2'", "ROLLBACK PREPARED 'golden_gx2'")
    return {"committed_gid": "golden_gx1", "rolled_back_gid": "golden_gx2"}


def _stream_prepare(dsn: str, drain: Drain) -> Notes:
    _run(dsn, "BEGIN", _big_insert(1, 1000), "PREPARE TRANSACTION 'golden_big'",
         "COMMIT PREPARED 'golden_big'")
    return {"gid": "golden_big", "rows": 1000}


_PUB = "CREATE PUBLICATION p FOR ALL TABLES;"
_S = "CREATE TABLE s (id int PRIMARY KEY, payload text);" + _PUB
_STREAM = (("streaming", "on"),)

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("basic", 1, "CREATE TABLE items (id int PRIMARY KEY, name text,"
             " price numeric(10,2), created timestamptz, active bool);" + _PUB, _basic),
    Scenario("key_update", 1, "CREATE TABLE kv (k int PRIMARY KEY, v text);" + _PUB,
             _key_update),
    Scenario("replica_identity", 1,
             "CREATE TABLE ri_default (id int PRIMARY KEY, v text);"
             "CREATE TABLE ri_index (id int NOT NULL, code text NOT NULL, v text);"
             "CREATE UNIQUE INDEX ri_index_code ON ri_index (code);"
             "ALTER TABLE ri_index REPLICA IDENTITY USING INDEX ri_index_code;"
             "CREATE TABLE ri_full (id int, v text);"
             "ALTER TABLE ri_full REPLICA IDENTITY FULL;"
             "CREATE TABLE ri_nothing (id int, v text);"
             "ALTER TABLE ri_nothing REPLICA IDENTITY NOTHING;" + _PUB, _replica_identity),
    Scenario("toast", 1, "CREATE TABLE big (id int PRIMARY KEY, payload text, counter int);"
             "ALTER TABLE big ALTER payload SET STORAGE EXTERNAL;" + _PUB, _toast),
    Scenario("binary", 1, "CREATE TABLE bin_types (id int8 PRIMARY KEY, flag bool,"
             " amount numeric, at timestamptz, blob bytea, uid uuid, doc jsonb, tags text[],"
             " note text);" + _PUB, _binary, options=(("binary", "true"),)),
    Scenario("messages", 1, "CREATE TABLE msg_t (id int PRIMARY KEY);" + _PUB, _messages,
             options=(("messages", "true"),)),
    Scenario("truncate", 1, "CREATE TABLE parent (id int PRIMARY KEY);"
             "CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent);"
             "CREATE TABLE counter_t (id serial PRIMARY KEY, v text);" + _PUB, _truncate),
    Scenario("types", 1, "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');"
             "CREATE TYPE pair AS (a int, b text);"
             "CREATE TABLE typed (id int PRIMARY KEY, m mood, p pair, ms mood[]);" + _PUB,
             _types),
    Scenario("origin", 1, "CREATE TABLE orig_t (id int PRIMARY KEY);" + _PUB, _origin),
    Scenario("stream_big", 2, _S, _stream_big, options=(*_STREAM, ("messages", "true"))),
    Scenario("stream_subxact_abort", 2, _S, _stream_subxact_abort, options=_STREAM),
    Scenario("stream_abort", 2, _S, _stream_abort, options=_STREAM),
    Scenario("stream_interleaved", 2, _S, _stream_interleaved, options=_STREAM),
    Scenario("two_phase", 3, "CREATE TABLE tp (id int PRIMARY KEY, v text);" + _PUB,
             _two_phase, options=(("two_phase", "on"),), two_phase=True),
    Scenario("stream_prepare", 3, _S, _stream_prepare,
             options=(*_STREAM, ("two_phase", "on")), two_phase=True),
)
BY_NAME = {s.name: s for s in SCENARIOS}


def capture(dsn: str, scenario: Scenario) -> dict[str, Any]:
    """Run one scenario in the (empty) database at ``dsn`` and return its capture record."""
    slot = f"golden_{scenario.name}_{uuid.uuid4().hex[:8]}"
    _run(dsn, scenario.setup)
    with _connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
                      (slot, scenario.two_phase))
        version = conn.execute("SHOW server_version").fetchone()
    options = [("proto_version", str(scenario.proto_version)), ("publication_names", "p"),
               *scenario.options]
    args = ", ".join("%s" for _ in range(2 * len(options)))
    rows: list[tuple[str, str, bytes]] = []

    def changes(function: str) -> None:
        flush_wal(dsn)
        with _connect(dsn, autocommit=True) as conn:
            rows.extend(conn.execute(
                f"SELECT lsn::text, xid::text, data FROM {function}(%s, NULL, NULL, {args})",
                (slot, *[item for pair in options for item in pair]),
            ).fetchall())

    try:
        notes = scenario.workload(dsn, lambda: changes("pg_logical_slot_get_binary_changes"))
        changes("pg_logical_slot_peek_binary_changes")
    finally:
        _run(dsn, f"SELECT pg_drop_replication_slot('{slot}')")
        if scenario.name == "origin":
            _run(dsn, "SELECT pg_replication_origin_drop('golden_origin')")
    return {
        "scenario": scenario.name,
        "proto_version": scenario.proto_version,
        "options": dict(scenario.options),
        "server_version": version[0] if version else None,
        "notes": notes,
        "messages": [{"lsn": lsn, "xid": int(xid), "data": bytes(data).hex()}
                     for lsn, xid, data in rows],
    }


def load(name: str, directory: Path = GOLDEN_DIR) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((directory / f"{name}.json").read_text())
    return result


def write(record: dict[str, Any], directory: Path = GOLDEN_DIR) -> Path:
    path = directory / f"{record['scenario']}.json"
    messages = ",\n".join(json.dumps(m) for m in record["messages"])
    head = json.dumps({k: v for k, v in record.items() if k != "messages"}, indent=1)
    path.write_text(head[:-2] + ',\n "messages": [\n' + messages + "\n ]\n}\n")
    return path


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else GOLDEN_DIR
    root = Path(tempfile.mkdtemp(prefix="pgsieve-golden-"))
    root.chmod(0o755)  # the server may run as another OS user
    cluster = LocalCluster(root / "data", free_port(), settings=CLUSTER_SETTINGS).start()
    try:
        for scenario in SCENARIOS:
            db = f"golden_{scenario.name}"
            _run(cluster.dsn(), f'CREATE DATABASE "{db}"')
            record = capture(cluster.dsn(db), scenario)
            print(f"{scenario.name}: {len(record['messages'])} messages -> {write(record, out)}")
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
