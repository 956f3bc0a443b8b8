"""Issue 17, hole 1: SQL through a row filter.

A filter is parsed with ``standard_conforming_strings = on``. A source session whose
setting came from the server (``ALTER DATABASE … SET standard_conforming_strings = off``,
a role setting, or ``options=-c …`` in the DSN) read ``'x\\'`` as an unterminated string
and the rest of the filter as SQL. Every filter below must be refused or stored/evaluated
as the expression it is, and the canary table must stay exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from pgsieve.api.app import create_app
from tests.api.conftest import TOKEN
from tests.conftest import Database

CANARY_ROWS = [(1,), (2,), (3,)]

# Each one, read by a session with standard_conforming_strings = off, closes a string
# early and runs ``DROP TABLE canary``.
INJECTIONS = [
    r"note = 'x\' OR note = '); DROP TABLE canary; --'",
    r"note = 'x\' OR note = '')); DROP TABLE canary; --'",
    r"note = 'x\' /* c */ OR note = '); DROP TABLE canary; --'",
    "note = $$x\\$$ OR note = $$'); DROP TABLE canary; --$$",
    "note = $q$x\\$q$ OR note = $q$); DROP TABLE canary; --$q$",
    r"note = E'x\\' OR note = '); DROP TABLE canary; --'",
    r"note = U&'x\005C' OR note = '); DROP TABLE canary; --'",
    "note = U&'x!005C' UESCAPE '!' OR note = '); DROP TABLE canary; --'",
    r"note = 'x\' OR note = ';' OR note = '); DROP TABLE canary; --'",
    r"note = 'x\'; DROP TABLE canary; --'",
    r"note = 'x\') ; DROP TABLE canary; --'",
    r"note = 'x\' -- ' ); DROP TABLE canary; --",
]


def _setup(db: Database, how: str) -> str:
    db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, note text);"
        "INSERT INTO t VALUES (1, 'x\\'), (2, '); DROP TABLE canary; --'), (3, 'plain');"
        "CREATE TABLE canary (id int PRIMARY KEY);"
        "INSERT INTO canary VALUES (1), (2), (3)"
    )
    if how == "database":
        db.execute(f'ALTER DATABASE "{db.name}" SET standard_conforming_strings = off')
        db.execute(f'ALTER DATABASE "{db.name}" SET escape_string_warning = off')
    if how == "dsn":
        return db.dsn + "?options=" + quote("-c standard_conforming_strings=off")
    return db.dsn


def _canary(db: Database) -> list[tuple[object, ...]]:
    return db.query("SELECT id FROM public.canary ORDER BY id")


@pytest.fixture(params=["database", "dsn", "on"])
def hostile(request: Any, client: Any, source_db: Database) -> tuple[str, Database]:
    dsn = _setup(source_db, request.param)
    r = client.post("/api/v1/sources", json={"name": "src", "dsn": dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"]), source_db


@pytest.mark.parametrize("where", INJECTIONS)
def test_publication_filter_cannot_run_sql(client, hostile, where):
    sid, db = hostile
    r = client.post(f"/api/v1/sources/{sid}/publications",
                    json={"name": "p", "tables": [{"table": "public.t", "where": where}],
                          "publish": ["insert"]})
    assert r.status_code in (201, 422), r.text
    assert _canary(db) == CANARY_ROWS
    if r.status_code == 201:
        # Stored as the expression it is: evaluated on the source, it matches the rows
        # whose note is one of the literals (rows 1 and 2), not some other statement.
        # (pg_get_expr writes literals for the session's own setting: read it back there.)
        with db.connect() as conn:
            stored = conn.execute(
                "SELECT pg_get_expr(prqual, prrelid) FROM pg_publication_rel").fetchall()
            assert len(stored) == 1
            expr = str(stored[0][0])
            ids = conn.execute(f"SELECT id FROM public.t WHERE {expr} ORDER BY id".encode()
                               ).fetchall()
        assert ids and {i for (i,) in ids} <= {1, 2}
        # A PATCH to the same filter goes through ALTER PUBLICATION: just as harmless.
        r = client.patch(f"/api/v1/sources/{sid}/publications/p",
                         json={"tables": [{"table": "public.t", "where": where}]})
        assert r.status_code in (200, 422), r.text
        assert _canary(db) == CANARY_ROWS


@pytest.mark.parametrize("where", INJECTIONS)
def test_preview_filter_cannot_run_sql(client, hostile, where):
    sid, db = hostile
    r = client.post(f"/api/v1/sources/{sid}/filter-preview",
                    json={"table": "public.t", "where": where, "publish": ["insert"],
                          "sample_size": 5})
    assert r.status_code == 200, r.text
    assert _canary(db) == CANARY_ROWS
    body = r.json()
    if body["valid"]:
        assert body["total_rows"] == 3
        assert {row["id"] for row in body["sample"]} <= {1, 2}
        assert body["matching_rows"] == len(body["sample"]) >= 1


# -- expensive but legal filters: every evaluation is under a statement timeout -------------

EXPENSIVE = "length(repeat(note, 100000000)) > 0"


@pytest.fixture
def heavy(settings: Any, metadata_engine: Any, source_db: Database) -> Iterator[Any]:
    # Each row costs a 100 MB string: 400 rows take tens of seconds without a timeout.
    source_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, note text NOT NULL);"
        "INSERT INTO t SELECT g, 'x' FROM generate_series(1, 400) g; ANALYZE t")
    # PGSIEVE_STATEMENT_TIMEOUT_MS bounds every step of an evaluation
    short = settings.model_copy(update={"statement_timeout_ms": 2000})
    with TestClient(create_app(short), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        r = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
        assert r.status_code == 201, r.text
        yield client, str(r.json()["id"]), source_db


def test_expensive_filter_preview_is_bounded(heavy):
    import time

    client, sid, db = heavy
    started = time.monotonic()
    r = client.post(f"/api/v1/sources/{sid}/filter-preview",
                    json={"table": "public.t", "where": EXPENSIVE, "publish": ["insert"],
                          "sample_size": 5})
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert elapsed < 8, elapsed
    # nothing left running on the source
    assert db.query("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND query LIKE '%repeat(note%' AND pid <> pg_backend_pid()") == [(0,)]


def test_expensive_filter_publication_is_bounded(heavy):
    import time

    client, sid, db = heavy
    started = time.monotonic()
    r = client.post(f"/api/v1/sources/{sid}/publications",
                    json={"name": "p", "tables": [{"table": "public.t", "where": EXPENSIVE}],
                          "publish": ["insert"]})
    elapsed = time.monotonic() - started
    assert r.status_code in (201, 422), r.text
    assert elapsed < 8, elapsed
    assert db.query("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND query LIKE '%repeat(note%' AND pid <> pg_backend_pid()") == [(0,)]


@pytest.mark.parametrize("where", INJECTIONS)
def test_rendered_filter_reads_the_same_under_either_setting(source_db: Database, where):
    """The text that reaches PostgreSQL (publication DDL, preview, the sync planner's and
    Spark's COPY queries all use the parse tree's rendering) means one thing whatever the
    session's standard_conforming_strings: the second wall behind the pinned setting."""
    from pgsieve.rowfilter.parse import FilterParseError, parse_filter

    _setup(source_db, "on")
    try:
        rendered = parse_filter(where).normalized
    except FilterParseError:
        return  # refused before any SQL
    results = []
    for setting in ("on", "off"):
        with source_db.connect() as conn:
            conn.execute(f"SET standard_conforming_strings = {setting}")
            conn.execute("SET escape_string_warning = off")
            rows = conn.execute(
                f"SELECT id FROM public.t WHERE ({rendered}) ORDER BY id".encode()).fetchall()
            results.append(rows)
    assert results[0] == results[1]
    assert _canary(source_db) == CANARY_ROWS
