"""Issue 54, hole 1: what a real pipeline records about rows reaches operators, never a
viewer token — a conflict's key, a missing row's key, and an apply error carrying
PostgreSQL's ``DETAIL: Key (nick)=(…) already exists``.

Two subscriptions on real clusters, streamed by a scheduler in this process: ``a``
(``on_conflict: error``) meets a row its target has already; ``b`` (``native``) skips an
UPDATE of a row its target lost, records an UPDATE's images (the UPDATE preview's
examples), then fails on a unique index only its target has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pgsieve.platform.db import session_factory
from pgsieve.security.tokens import create_token
from pgsieve.streaming.scheduler import Scheduler
from tests.conftest import Database
from tests.integration.pipeline_env import PipelineEnv, pipeline_env, wait_until

CONFLICTING = "conflict-row@example.com"
MISSING = "missing-row@example.com"
DUPLICATE = "dup-nick-7c1f"
IMAGED = "updated-nick-90ab"  # in an UPDATE image the pipeline records


def _get(env: PipelineEnv, token: str, path: str) -> str:
    r = env.client.get(f"/api/v1{path}", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return str(r.text)


def test_row_values_reach_operators_and_never_a_viewer(
        tmp_path: Path, source_db: Database, target_db: Database) -> None:
    source_db.execute("""
        CREATE TABLE a (email text PRIMARY KEY, nick text);
        CREATE TABLE b (email text PRIMARY KEY, nick text);
        CREATE PUBLICATION pub_a FOR TABLE a; CREATE PUBLICATION pub_b FOR TABLE b""")
    target_db.execute(f"""
        CREATE TABLE a (email text PRIMARY KEY, nick text);
        CREATE TABLE b (email text PRIMARY KEY, nick text UNIQUE);
        INSERT INTO a VALUES ('{CONFLICTING}', 'there already')""")
    with pipeline_env(tmp_path) as env:
        src, tgt = env.register(source_db, target_db)
        subs = {name: env.api("POST", "/subscriptions", json={
            "name": name, "source_id": src, "target_id": tgt, "publications": [f"pub_{name}"],
            "copy_data": False, "options": {"on_conflict": policy}})["id"]
            for name, policy in (("a", "error"), ("b", "native"))}
        sessions = session_factory(env.settings.effective_database_url)
        with sessions() as session:
            tokens = {role: create_token(session, f"t-{role}", role)[1]
                      for role in ("viewer", "operator")}
        scheduler = Scheduler(env.settings, planner=lambda: None, sessions=sessions)
        scheduler.start()
        try:
            source_db.execute(f"INSERT INTO a VALUES ('{CONFLICTING}', 'x')")
            source_db.execute(f"INSERT INTO b VALUES ('{MISSING}', 'first')")
            wait_until(lambda: target_db.query("SELECT count(*) FROM b")[0][0] == 1, 60,
                       "b's first row", env)
            target_db.execute("DELETE FROM b")
            source_db.execute("UPDATE b SET nick = 'second'")
            wait_until(lambda: _missing(env, subs["b"]) is not None, 60, "the skipped UPDATE",
                       env)
            source_db.execute("INSERT INTO b VALUES ('imaged@example.com', 'before')")
            source_db.execute(f"UPDATE b SET nick = '{IMAGED}' WHERE nick = 'before'")
            wait_until(lambda: target_db.query(
                f"SELECT count(*) FROM b WHERE nick = '{IMAGED}'")[0][0] == 1, 60,
                "the recorded UPDATE", env)
            source_db.execute(f"INSERT INTO b VALUES ('one@example.com', '{DUPLICATE}'), "
                              f"('two@example.com', '{DUPLICATE}')")
            wait_until(lambda: all(_state(env, s) == "error" for s in subs.values()), 60,
                       "the stops", env)
        finally:
            scheduler.stop(10)
        a, b = env.subscription(subs["a"]), env.subscription(subs["b"])
        assert a["conflict"]["key"] == {"email": CONFLICTING}, a
        assert DUPLICATE in b["error"] and "Key (nick)" in b["error"], b
        reads = [path for sub in subs.values()
                 for path in ("/subscriptions", f"/subscriptions/{sub}",
                              f"/subscriptions/{sub}/progress")]
        operator = "".join(_get(env, tokens["operator"], path) for path in reads)
        viewer = "".join(_get(env, tokens["viewer"], path) for path in reads)
        for value in (CONFLICTING, MISSING, DUPLICATE):
            assert value in operator, value  # (so the viewer's check below can fail)
            assert value not in viewer, value
        # the UPDATE images, through the preview of the stored publication's filter
        env.api("POST", f"/sources/{src}/publications/import", json={"names": ["pub_b"]})
        preview = {"table": "public.b", "publication": "pub_b",
                   "subscription_id": subs["b"]}

        def previewed(role: str) -> str:
            r = env.client.post(f"/api/v1/sources/{src}/filter-preview", json=preview,
                                headers={"Authorization": f"Bearer {tokens[role]}"})
            assert r.status_code == 200, r.text
            return str(r.text)

        wait_until(lambda: IMAGED in previewed("operator"), 30, "the recorded images", env)
        assert IMAGED not in previewed("viewer")
        seen: dict[str, Any] = dict(env.client.get(
            f"/api/v1/subscriptions/{subs['a']}",
            headers={"Authorization": f"Bearer {tokens['viewer']}"}).json())
        # what is left: that it stopped, on which table, and why in a stable code
        assert seen["state"] == "error" and seen["error"].startswith("(withheld")
        assert (seen["conflict"]["table"], seen["conflict"]["kind"], seen["conflict"]["key"]
                ) == (a["conflict"]["table"], a["conflict"]["kind"], None)


def _state(env: PipelineEnv, sub: str) -> str:
    return str(env.subscription(sub)["state"])


def _missing(env: PipelineEnv, sub: str) -> Any:
    tables = env.subscription(sub)["tables"]
    return tables[0]["last_missing"] if tables else None
