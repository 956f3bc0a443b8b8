"""One list convention on every collection: ``limit`` and ``cursor``, the body the array it
always was, ``Link: <…>; rel="next"`` while more remain and never on the last page.
Walking any collection page by page returns every item exactly once, in the order of the
unpaged list; items inserted meanwhile shift nothing; nothing is silently capped."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.platform.models import Job, SchemaChangeRecord, utcnow
from tests.api.conftest import assert_problem
from tests.conftest import Database

LINK = re.compile(r'^<([^>]+)>; rel="next"$')


def _walk(client, path: str, limit: int, items: str | None = None
          ) -> tuple[list[Any], list[bool]]:
    """Every page of ``path`` from the first, following Link rel=next: the items and, per
    page, whether it had a Link."""
    url: str | None = f"{path}{'&' if '?' in path else '?'}limit={limit}"
    out: list[Any] = []
    links: list[bool] = []
    while url is not None:
        r = client.get(url)
        assert r.status_code == 200, r.text
        body = r.json()
        page = body[items] if items else body
        assert isinstance(page, list)
        assert len(page) <= limit
        out += page
        link = r.headers.get("link")
        links.append(link is not None)
        if link is not None:
            found = LINK.match(link)
            assert found, link
            url = found.group(1)
            assert f"limit={limit}" in url
        else:
            url = None
        assert len(links) < 1000
    return out, links


def _check_walk(client, path: str, key: str, limit: int, items: str | None = None,
                whole: int = 1000) -> int:
    everything = client.get(f"{path}{'&' if '?' in path else '?'}limit={whole}")
    assert everything.status_code == 200, everything.text
    assert "link" not in everything.headers
    full = everything.json()[items] if items else everything.json()
    walked, links = _walk(client, path, limit, items)
    assert [i[key] for i in walked] == [i[key] for i in full], path
    assert len({i[key] for i in walked}) == len(walked), f"{path}: an item twice"
    pages = max(1, math.ceil(len(full) / limit))
    assert len(links) == pages, (path, len(full), limit)
    assert links == [True] * (pages - 1) + [False], path
    return len(full)


@pytest.fixture
def populated(client, metadata_engine, source_db: Database, target_db: Database
              ) -> dict[str, Any]:
    source_db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text);"
                      "CREATE PUBLICATION p_all FOR TABLE public.t;"
                      "CREATE PUBLICATION p_b FOR TABLE public.t WHERE (id > 1);"
                      "CREATE PUBLICATION p_c FOR TABLE public.t WHERE (id > 2);")
    target_db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    sources = [client.post("/api/v1/sources", json={"name": f"src{i}", "dsn": source_db.dsn})
               for i in range(3)]
    targets = [client.post("/api/v1/targets", json={"name": f"tgt{i}", "dsn": target_db.dsn})
               for i in range(3)]
    assert all(r.status_code == 201 for r in sources + targets)
    source_id, target_id = sources[0].json()["id"], targets[0].json()["id"]
    for i in range(3):
        r = client.post(f"/api/v1/sources/{source_id}/slots", json={"name": f"slot_{i}"})
        assert r.status_code == 201, r.text
    subs = []
    for i in range(3):
        r = client.post("/api/v1/subscriptions", json={
            "name": f"sub{i}", "source_id": source_id, "target_id": target_id,
            "publications": ["p_all"], "copy_data": False, "enabled": False})
        assert r.status_code == 201, r.text
        subs.append(r.json()["id"])
    for i in range(4):
        assert client.post("/api/v1/tokens",
                           json={"name": f"tok{i}", "role": "viewer"}).status_code == 201
    # more jobs than /jobs used to show (200), many created at the same instant
    at = utcnow()
    with Session(metadata_engine) as session:
        session.add_all(Job(kind="sync", subscription_id=subs[i % 3], state="done",
                            created_at=at - timedelta(seconds=i // 10)) for i in range(205))
        session.add_all(SchemaChangeRecord(
            subscription_id=subs[0], table_name="public.t", lsn=0x1000 + i,
            change="add_column", column_name=f"c{i}", before=None,
            after={"column": f"c{i}", "type": "text"}, action="applied", code=None,
            ddl=[]) for i in range(5))
        session.commit()
    return {"source_id": source_id, "subscriptions": subs}


def test_every_collection_pages_each_item_exactly_once(client, populated) -> None:
    sid = populated["source_id"]
    assert _check_walk(client, "/api/v1/sources", "id", 2) == 3
    assert _check_walk(client, "/api/v1/targets", "id", 1) == 3
    assert _check_walk(client, f"/api/v1/sources/{sid}/slots", "name", 2) >= 6
    assert _check_walk(client, f"/api/v1/sources/{sid}/publications", "name", 2) == 3
    assert _check_walk(client, "/api/v1/subscriptions", "id", 2) == 3
    assert _check_walk(client, "/api/v1/tokens", "name", 2) == 5
    assert _check_walk(client, "/api/v1/jobs", "id", 50) == 205  # not capped at 200
    sub = populated["subscriptions"][0]
    assert _check_walk(client, f"/api/v1/jobs?subscription_id={sub}", "id", 7) == 69
    assert _check_walk(client, "/api/v1/audit", "id", 4, items="events", whole=500) > 10
    assert _check_walk(client, f"/api/v1/subscriptions/{sub}/schema-changes", "lsn", 2) == 5
    # a page exactly as long as what remains has no Link
    assert _check_walk(client, "/api/v1/sources", "id", 3) == 3


def test_without_limit_a_client_gets_what_it_got_before(client, populated) -> None:
    r = client.get("/api/v1/jobs")
    assert r.status_code == 200
    assert len(r.json()) == 205 and "link" not in r.headers
    assert len(client.get("/api/v1/subscriptions").json()) == 3


def test_items_added_while_paging_shift_nothing(client, populated) -> None:
    first = client.get("/api/v1/tokens", params={"limit": 2})
    assert [t["name"] for t in first.json()] == ["bootstrap", "tok0"]
    next_url = LINK.match(first.headers["link"]).group(1)  # type: ignore[union-attr]
    # one before the cursor, one after it
    for name in ("aaa", "zzz"):
        assert client.post("/api/v1/tokens", json={"name": name, "role": "viewer"}
                           ).status_code == 201
    rest, _ = _walk(client, next_url, 2)
    assert [t["name"] for t in rest] == ["tok1", "tok2", "tok3", "zzz"]


def test_audit_keeps_before_and_next_before(client, populated) -> None:
    first = client.get("/api/v1/audit", params={"limit": 3})
    body = first.json()
    assert len(body["events"]) == 3 and body["next_before"] == body["events"][-1]["id"]
    by_link = client.get(LINK.match(first.headers["link"]).group(1)).json()  # type: ignore[union-attr]
    by_before = client.get("/api/v1/audit",
                           params={"limit": 3, "before": body["next_before"]}).json()
    assert by_link["events"] == by_before["events"]


def test_schema_changes_take_the_cursor_their_links_carried_before(
        client, populated, metadata_engine) -> None:
    sub = populated["subscriptions"][0]
    with Session(metadata_engine) as session:
        ids = sorted(session.scalars(select(SchemaChangeRecord.id)))
    older = client.get(f"/api/v1/subscriptions/{sub}/schema-changes",
                       params={"cursor": str(ids[2]), "limit": 10})
    assert [c["lsn"] for c in older.json()] == ["0/1001", "0/1000"]


def test_bad_cursors_and_limits_are_refused(client, populated) -> None:
    for cursor in ("x", "bm90IGpzb24", "WzEsMiwzXQ", "eyJhIjoxfQ", "W3sidCI6IngifV0"):
        assert_problem(client.get("/api/v1/jobs", params={"cursor": cursor}),
                       400, "invalid_cursor")
    assert_problem(client.get("/api/v1/audit", params={"cursor": "WyJ4Il0"}),
                   400, "invalid_cursor")
    assert_problem(client.get("/api/v1/jobs", params={"limit": 1001}), 422,
                   "validation_error")
    assert_problem(client.get("/api/v1/jobs", params={"limit": 0}), 422, "validation_error")
    assert_problem(client.get("/api/v1/audit", params={"limit": 501}), 422,
                   "validation_error")


def test_alert_channels_and_rules_page_each_item_exactly_once(client) -> None:
    for i in range(3):
        r = client.post("/api/v1/alerts/channels", json={
            "name": f"ch{i}", "kind": "webhook", "url": f"http://127.0.0.1:9/hook{i}"})
        assert r.status_code == 201, r.text
        r = client.post("/api/v1/alerts/rules", json={
            "name": f"rule{i}", "kind": "lag_seconds", "threshold": 60 + i,
            "channels": [f"ch{i}"]})
        assert r.status_code == 201, r.text
    assert _check_walk(client, "/api/v1/alerts/channels", "id", 2) == 3
    assert _check_walk(client, "/api/v1/alerts/rules", "id", 2) == 3
    assert _check_walk(client, "/api/v1/alerts", "id", 2) == 0
