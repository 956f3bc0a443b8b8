"""Target table shapes cached by a :class:`TargetWriter` (real target cluster): once
``SHAPE_TTL_SECONDS`` old they are checked in one query, kept while the catalog is
unchanged and read again for exactly the tables whose catalog rows changed — a new
column, a new unique index, a replica identity index, a rename, a table dropped and
created again. Every one of these must be seen: a stale shape would apply rows by the
wrong key or drop a column's values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import conninfo

from pgsieve.apply.shapes import TableMissing
from pgsieve.apply.target import TargetWriter
from tests.conftest import Database


@pytest.fixture
def writer(target_db: Database) -> Iterator[TargetWriter]:
    target_db.execute("""
        CREATE TABLE a (id int PRIMARY KEY, v text);
        CREATE TABLE b (id int PRIMARY KEY, w text);
    """)
    w = TargetWriter(target_db.dsn, "shapes")
    try:
        yield w
    finally:
        w.close()


def _expire(writer: TargetWriter) -> None:
    writer.shapes.checked_at -= 3600  # as if the TTL had passed


def test_unchanged_shapes_are_kept_past_their_ttl(writer: TargetWriter) -> None:
    a, b = writer.table("public.a"), writer.table("public.b")
    _expire(writer)
    assert writer.refresh_shapes() is True  # checked now: as fresh as a re-read
    assert writer.table("public.a") is a and writer.table("public.b") is b
    # within the TTL nothing is checked
    assert writer.refresh_shapes() is False


@pytest.mark.parametrize(("ddl", "changed"), [
    ("ALTER TABLE a ADD COLUMN extra int", lambda t: "extra" in [c.name for c in t.columns]),
    ("ALTER TABLE a DROP COLUMN v", lambda t: [c.name for c in t.columns] == ["id"]),
    ("ALTER TABLE a ALTER COLUMN v SET NOT NULL",
     lambda t: [c.not_null for c in t.columns] == [True, True]),
    ("ALTER TABLE a ALTER COLUMN v TYPE varchar(5)",
     lambda t: t.columns[1].type_name == "character varying(5)"),
    ("CREATE UNIQUE INDEX a_v ON a (v)", lambda t: frozenset({"v"}) in t.unique),
    ("CREATE UNIQUE INDEX a_v ON a (v); ALTER TABLE a ALTER COLUMN v SET NOT NULL;"
     "ALTER TABLE a REPLICA IDENTITY USING INDEX a_v", lambda t: t.identity == ("v",)),
    ("ALTER TABLE a DROP CONSTRAINT a_pkey", lambda t: t.identity == () and not t.unique),
    ("DROP TABLE a; CREATE TABLE a (id bigint PRIMARY KEY, v text, z int)",
     lambda t: [c.name for c in t.columns] == ["id", "v", "z"]),
])
def test_a_changed_table_is_read_again_and_only_it(
        writer: TargetWriter, target_db: Database, ddl: str,
        changed: Callable[..., bool]) -> None:
    a, b = writer.table("public.a"), writer.table("public.b")
    assert not changed(a)
    target_db.execute(ddl)
    _expire(writer)
    writer.refresh_shapes()
    fresh = writer.table("public.a")
    assert fresh is not a and changed(fresh)
    assert writer.table("public.b") is b


def test_a_renamed_or_dropped_table_is_missing_after_the_check(
        writer: TargetWriter, target_db: Database) -> None:
    writer.table("public.a")
    writer.table("public.b")
    target_db.execute("ALTER TABLE a RENAME TO a2; DROP TABLE b")
    _expire(writer)
    writer.refresh_shapes()
    for name in ("public.a", "public.b"):
        with pytest.raises(TableMissing):
            writer.table(name)
    assert [c.name for c in writer.table("public.a2").columns] == ["id", "v"]


@pytest.fixture
def plain_role(target_db: Database) -> Iterator[str]:
    """A login role of this test's own on the target cluster, not a superuser."""
    role = f"shapes_{target_db.name}"[:60]
    target_db.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
    try:
        yield role
    finally:
        with contextlib.suppress(psycopg.Error):
            target_db.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


def _learn_role(writer: TargetWriter) -> bool:
    with writer.conn.transaction():
        return writer.replica_role(writer.conn)


def _session_role(writer: TargetWriter) -> str:
    row = writer.conn.execute("SHOW session_replication_role").fetchone()
    assert row is not None
    return str(row[0])


def test_the_replica_role_answer_follows_the_role_across_checks(
        target_db: Database, plain_role: str) -> None:
    """A superuser's session runs as replica from the check that finds it one (every
    batch can go as one script, no SET per transaction); a role that lost superuser gets
    a new session (it could not set the role back) and is asked again at the next batch;
    one that gains it again is back to a replica session — without a batch having to
    fail first."""
    target_db.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
    dsn = conninfo.make_conninfo(target_db.dsn, user=plain_role)
    with contextlib.closing(TargetWriter(dsn, "roles")) as writer:
        writer.table("public.a")
        assert _session_role(writer) == "origin"
        target_db.execute(f"ALTER ROLE {plain_role} SUPERUSER")
        assert _learn_role(writer) is True
        assert writer.replica_role_per_transaction()  # not yet for the session
        _expire(writer)
        writer.refresh_shapes()
        assert writer.replica_role_known() is True  # kept: still a superuser
        assert not writer.replica_role_per_transaction()
        assert _session_role(writer) == "replica"

        first_session = writer.conn
        target_db.execute(f"ALTER ROLE {plain_role} NOSUPERUSER")
        _expire(writer)
        writer.refresh_shapes()
        assert writer.conn is not first_session and first_session.closed
        assert _session_role(writer) == "origin"
        assert writer.replica_role_known() is None  # asked again at the next batch
        assert _learn_role(writer) is False

        target_db.execute(f"ALTER ROLE {plain_role} SUPERUSER")
        _expire(writer)
        writer.refresh_shapes()
        assert writer.replica_role_known() is True
        assert _session_role(writer) == "replica"
        assert _learn_role(writer) is True


def test_a_superuser_writer_runs_its_session_as_replica(target_db: Database) -> None:
    """Set once when the writer connects, as PostgreSQL's apply worker does (a SET per
    transaction reset the server's plan cache at every batch): a transaction that sets
    nothing itself still fires no ordinary trigger, and one enabled ALWAYS still fires."""
    target_db.execute("""
        CREATE TABLE a (id int PRIMARY KEY, v text);
        CREATE TABLE fired (name text);
        CREATE FUNCTION note() RETURNS trigger LANGUAGE plpgsql AS
          $$BEGIN INSERT INTO public.fired VALUES (TG_NAME); RETURN NEW; END$$;
        CREATE TRIGGER ordinary BEFORE INSERT ON a FOR EACH ROW EXECUTE FUNCTION note();
        CREATE TRIGGER always BEFORE INSERT ON a FOR EACH ROW EXECUTE FUNCTION note();
        ALTER TABLE a ENABLE ALWAYS TRIGGER always""")
    with contextlib.closing(TargetWriter(target_db.dsn, "replica-session")) as writer:
        assert _session_role(writer) == "replica"
        assert writer.replica_role_known() is True
        assert not writer.replica_role_per_transaction()
        for i in range(3):
            with writer.conn.transaction():
                assert _learn_role(writer) is True
                writer.conn.execute("INSERT INTO public.a VALUES (%s, 'x')", (i,))
        assert _session_role(writer) == "replica"
    assert target_db.query("SELECT name FROM fired") == [("always",)] * 3
