"""The target's schema-change journal delivered to the metadata store: records, audit,
the diff resync a change asked for, the metric — and delivered again (a worker killed
after the target's commit, before it deleted the journal) nothing is recorded twice."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker

from pgsieve.apply.batch import SchemaChange
from pgsieve.apply.schemachange import run_in_merge, take_journal
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.models import AuditEvent, Job, SchemaChangeRecord
from pgsieve.streaming.schemarecords import deliver_journal
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database

SCHEMA = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text NOT NULL);
CREATE PUBLICATION pub_orders FOR TABLE public.orders WHERE (region = 'eu');
"""


def _count(engine: Any, model: Any, *where: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(model).where(*where))
                   .scalar_one())


def test_journal_delivered_once(client, settings, metadata_engine, source_db: Database,
                                target_db: Database):
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA.split(";")[0])
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn}).json()
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn}).json()
    sub = client.post("/api/v1/subscriptions", json={
        "name": "sub1", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub_orders"], "copy_data": False, "enabled": False}).json()
    sid = sub["id"]
    changes = [
        SchemaChange("public.orders", Lsn(0x2000), "add_column", "note", None, "text",
                     "applied", None, ('ALTER TABLE "public"."orders" ADD COLUMN "note" text',)),
        SchemaChange("public.orders", Lsn(0x2000), "add_column", "r", None, "double precision",
                     "resynced", None,
                     ('ALTER TABLE "public"."orders" ADD COLUMN "r" double precision',), True),
    ]
    writer = TargetWriter(target_db.dsn, sid, source_dsn=source_db.dsn)
    try:
        writer.ensure_schema()
        with writer.conn.transaction():
            run_in_merge(writer.conn, sid, changes)
        sessions = sessionmaker(metadata_engine)
        audited = _count(metadata_engine, AuditEvent)
        recorded = deliver_journal(sessions, settings, writer, sid, beside_merges=True)
        assert [c.column for c in recorded] == ["note", "r"]
        assert take_journal(writer.conn, sid) == []
        assert _count(metadata_engine, SchemaChangeRecord) == 2
        assert _count(metadata_engine, AuditEvent, AuditEvent.method == "STREAM") == 2
        assert _count(metadata_engine, AuditEvent) == audited + 2
        with metadata_engine.connect() as conn:
            job = conn.execute(select(Job.kind, Job.state, Job.details)
                               .where(Job.subscription_id == sid)).one()
        assert (job.kind, job.state) == ("resync", "queued")
        assert job.details["mode"] == "diff" and job.details["tables"] == ["public.orders"]

        # Delivered again (the journal rows were left behind by a kill): nothing new.
        with writer.conn.cursor() as cur:
            cur.execute("INSERT INTO pgsieve.schema_changes "
                        "SELECT %s, '0/2000', 'public.orders', 'add_column', 'r', "
                        "'{\"column\": \"r\", \"after\": \"double precision\", "
                        "\"action\": \"resynced\", \"resync\": true}'", (sid,))
        assert deliver_journal(sessions, settings, writer, sid, beside_merges=False) == []
        assert take_journal(writer.conn, sid) == []
        assert _count(metadata_engine, SchemaChangeRecord) == 2
        assert _count(metadata_engine, Job, Job.subscription_id == sid) == 1
        assert _count(metadata_engine, AuditEvent, AuditEvent.method == "STREAM") == 2
    finally:
        writer.close()

    listed = client.get(f"/api/v1/subscriptions/{sid}/schema-changes").json()
    assert [(c["after"]["column"], c["action"], c["lsn"]) for c in listed] == [
        ("r", "resynced", "0/2000"), ("note", "applied", "0/2000")]
    metrics = client.get("/metrics").text
    assert ('pgsieve_schema_changes_total{action="resynced",change="add_column",'
            'subscription="sub1"} 1.0') in metrics
