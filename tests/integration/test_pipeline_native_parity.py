"""Issue 15's apply cases end to end: through pgsieve's API with default options, a real
worker, and a native subscription fed the same workload; whole tables compared, and the
skipped missing rows visible where a user looks (subscription, /progress, /metrics)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.pipeline_env import (
    native_caught_up,
    native_subscription,
    pipeline_env,
    source_lsn,
    table_rows,
    wait_until,
)

SOURCE = """
CREATE TABLE m (id int PRIMARY KEY, v text);
INSERT INTO m SELECT g, 'src' || g FROM generate_series(1, 12) g;
CREATE TABLE f (id int PRIMARY KEY, v text, note text);
ALTER TABLE f REPLICA IDENTITY FULL;
INSERT INTO f SELECT g, 'v' || g, 'source' FROM generate_series(1, 6) g;
CREATE TABLE e1 (id int PRIMARY KEY, v text);
CREATE PUBLICATION parity FOR TABLE m, f, e1;
"""
TARGET = """
CREATE TABLE m (id int PRIMARY KEY, v text);
INSERT INTO m SELECT g, 'tgt' || g FROM generate_series(1, 5) g;
CREATE TABLE f (id int PRIMARY KEY, v text, note text);
INSERT INTO f SELECT g, 'v' || g, 'target differs' FROM generate_series(1, 6) g;
CREATE TABLE e1 (id int PRIMARY KEY, v text);
"""
WORKLOAD = (
    "UPDATE m SET v = v || '!' WHERE id % 2 = 0",
    "DELETE FROM m WHERE id IN (3, 7)",
    "INSERT INTO m VALUES (20, 'twenty')",
    "UPDATE f SET v = 'changed' WHERE id <= 3",
    "DELETE FROM f WHERE id = 6",
    "INSERT INTO e1 SELECT g, 'v' || g FROM generate_series(1, 6) g",
    "ALTER TABLE e1 REPLICA IDENTITY FULL",
    "UPDATE e1 SET v = 'after' WHERE id <= 3",
    "DELETE FROM e1 WHERE id = 4",
    "UPDATE m SET v = 'last' WHERE id = 11",
)


def test_default_options_end_like_native_and_show_the_skipped_rows(
        tmp_path: Path, source_db, target_db, native_db):
    source_db.execute(SOURCE)
    target_db.execute(TARGET)
    native_db.execute(TARGET)
    with pipeline_env(tmp_path) as env:
        source_id, target_id = env.register(source_db, target_db)
        sub = env.api("POST", "/subscriptions", json={
            "name": "parity", "source_id": source_id, "target_id": target_id,
            "publications": ["parity"], "copy_data": False,
            "options": {"batch_max_wait_ms": 200}})
        assert sub["options"]["on_conflict"] == "native"
        native_subscription(source_db, native_db, "native_parity", ["parity"])
        env.start_worker()
        for statement in WORKLOAD:
            source_db.execute(statement)
        end = source_lsn(source_db)
        wait_until(lambda: native_caught_up(source_db, native_db, "native_parity", end), 60,
                   "the native subscriber")

        def same() -> bool:
            return all(table_rows(target_db, t, "id") == table_rows(native_db, t, "id")
                       for t in ("m", "f", "e1"))

        wait_until(same, 90, "pgsieve's target to equal native's", env)
        wait_until(lambda: env.subscription(sub["id"])["applied_lsn"] is not None
                   and env.subscription(sub["id"])["missing_skipped"] >= 5, 30,
                   "the skipped rows to be recorded", env)
        detail = env.subscription(sub["id"])
        assert detail["state"] == "streaming" and detail["error"] is None
        tables = {t["table"]: t for t in detail["tables"]}
        m = tables["public.m"]
        assert m["missing_skipped"] >= 5  # 6, 8, 10, 12 updated; 7 deleted; 11 updated
        assert m["last_missing"]["op"] == "update" and m["last_missing"]["key"] == {"id": "11"}
        assert tables["public.f"]["missing_skipped"] == 0
        assert tables["public.e1"]["missing_skipped"] == 0

        progress = env.api("GET", f"/subscriptions/{sub['id']}/progress")
        assert progress["missing_skipped"] == detail["missing_skipped"]
        ptables = {t["table"]: t for t in progress["tables"]}
        assert ptables["public.m"]["last_missing"]["lsn"] == m["last_missing"]["lsn"]

        metrics = env.client.get("/metrics").text
        line = next(x for x in metrics.splitlines()
                    if x.startswith("pgsieve_table_missing_rows_skipped_total")
                    and 'table="public.m"' in x)
        assert float(line.rsplit(" ", 1)[1]) == m["missing_skipped"]
