"""Random moves of rows with out-of-line values in and out of a row filter and between
keys, applied in batches read while the source is far ahead, against the source.

An UPDATE that enters the filter arrives as an INSERT whose unchanged TOAST columns have
no value; pgsieve reads them from the source, ahead of the stream, and marks them until
the stream passes the read (:mod:`pgsieve.apply.fetchmarks`). Native PostgreSQL writes
NULL there for good, so it is no oracle here: the source's rows under the filter are.
Every round writes all its transactions before pgsieve reads one, the hardest case for a
read ahead: by then rows have moved on, other rows have taken their keys, rows are gone.
The suite runs seeds 7 and 8 (``PGSIEVE_FUZZ_SEEDS=1-40`` runs more, see
:mod:`tests.integration.test_apply_fuzz`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pgsieve.apply import plan as plan_module
from pgsieve.apply.engine import apply_batch
from tests.conftest import Database
from tests.integration import test_apply_fuzz as fuzz
from tests.integration.test_apply import Pair

SOURCE = """
CREATE TABLE tb (id int PRIMARY KEY, note text, body text, body2 text);
ALTER TABLE tb ALTER COLUMN body SET STORAGE EXTERNAL;
ALTER TABLE tb ALTER COLUMN body2 SET STORAGE EXTERNAL;
CREATE TABLE tc (a int, b int, note text, body text, PRIMARY KEY (a, b));
ALTER TABLE tc ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE PUBLICATION p FOR TABLE tb WHERE (id > 12), tc WHERE (a > 3);
"""
QUERIES = {
    "tb": "SELECT id, note, md5(body), md5(body2) FROM tb WHERE id > 12 ORDER BY id",
    "tc": "SELECT a, b, note, md5(body) FROM tc WHERE a > 3 ORDER BY a, b",
}
"""Each table's rows under its filter; the target holds only those, so the same query
reads all of its rows."""
KEYS = 24

Op = Callable[[random.Random], tuple[str, tuple[Any, ...]]]


def big(rnd: random.Random) -> str | None:
    """Stored out of line (EXTERNAL, ~5 kB) but now and then NULL or short."""
    roll = rnd.random()
    if roll < 0.1:
        return None
    if roll < 0.2:
        return f"short {roll:.6f}"
    return f"{rnd.random():.12f}" * 400


def ops() -> list[tuple[float, Op]]:
    def key(rnd: random.Random) -> int:
        return rnd.randint(1, KEYS)

    def pair_key(rnd: random.Random) -> tuple[int, int]:
        return rnd.randint(1, 8), rnd.randint(1, 3)

    return [
        (2, lambda r: ("INSERT INTO tb VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                       (key(r), fuzz.text(r), big(r), big(r)))),
        # a key change that leaves both values unchanged: into the filter it arrives as an
        # INSERT without them, within it as an UPDATE that keeps them
        (10, lambda r: ("UPDATE tb SET id = %s WHERE id = %s AND NOT EXISTS "
                       "(SELECT 1 FROM tb WHERE id = %s)", (n := key(r), key(r), n))),
        (2, lambda r: ("UPDATE tb SET note = %s WHERE id = %s", (fuzz.text(r), key(r)))),
        (1, lambda r: ("UPDATE tb SET body = %s WHERE id = %s", (big(r), key(r)))),
        (1, lambda r: ("UPDATE tb SET body2 = %s, id = id + 1 WHERE id = %s AND NOT EXISTS "
                       "(SELECT 1 FROM tb WHERE id = %s)", (big(r), n := key(r), n + 1))),
        (1, lambda r: ("DELETE FROM tb WHERE id = %s", (key(r),))),
        (2, lambda r: ("INSERT INTO tc VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                       (*pair_key(r), fuzz.text(r), big(r)))),
        (3, lambda r: ("UPDATE tc SET a = %s, b = %s WHERE (a, b) = (%s, %s) AND NOT EXISTS "
                       "(SELECT 1 FROM tc WHERE (a, b) = (%s, %s))",
                       (*(n2 := pair_key(r)), *pair_key(r), *n2))),
        (1, lambda r: ("DELETE FROM tc WHERE (a, b) = (%s, %s)", pair_key(r))),
        (0.2, lambda r: ("TRUNCATE tc", ())),
    ]


def write_round(pair: Pair, rnd: random.Random, transactions: int) -> None:
    choices = ops()
    weights = [w for w, _ in choices]
    with pair.source.connect() as conn:
        for _ in range(transactions):
            with conn.transaction():
                for _ in range(rnd.randint(1, 3)):
                    stmt, params = rnd.choices(choices, weights)[0][1](rnd)
                    # now and then in a subtransaction rolled back: never in the stream
                    with conn.transaction(force_rollback=rnd.random() < 0.1):
                        conn.execute(stmt.encode(), params)


def run_against_source(pair: Pair, seed: int, *, per_batch: int | None, restarts: bool,
                       planner: Any = None, distributed: bool = False) -> None:
    """Rounds of random transactions, each applied in batches of ``per_batch`` (None: a
    random size per batch) after all of it was written; the target must equal the source
    under the filters after every round, with no mark the stream passed left (a read in
    the last batch may be ahead of it still: the source's WAL moves on by itself).
    ``restarts``: a new writer
    (a restarted worker) now and then, which reads the marks from the target."""
    rnd = random.Random(seed)
    pair.setup(SOURCE, tables=["public.tb", "public.tc"])
    for round_ in range(3):
        write_round(pair, rnd, 60)
        txns = pair.read()
        i = 0
        while i < len(txns):
            size = per_batch or rnd.choice([1, 1, 2, 5, 20])
            [batch] = pair.batches(txns[i:i + size], None)
            apply_batch(planner, batch, pair.writer, distributed=distributed)
            i += size
            if restarts and rnd.random() < 0.2:
                pair.close()
        for table, query in QUERIES.items():
            ours, source = pair.target.query(query), pair.source.query(query)
            assert ours == source, (
                f"seed {seed}, round {round_}, {table}: only pgsieve has "
                f"{sorted(set(ours) - set(source))[:5]}, only the source has "
                f"{sorted(set(source) - set(ours))[:5]}")
        left = pair.target.query(
            "SELECT count(*) FROM pgsieve.fetched f JOIN pgsieve.applied a "
            "USING (subscription_id) WHERE f.source_lsn <= a.end_lsn")
        assert left == [(0,)], f"seed {seed}, round {round_}: marks the stream passed are left"


@pytest.fixture
def pair(source_db: Database, target_db: Database) -> Iterator[Pair]:
    p = Pair(source_db, target_db, None, ("p",))
    yield p
    p.close()


@pytest.mark.parametrize("seed", fuzz.seeds())
@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "mixed"])
def test_random_moves_of_unchanged_toast_end_like_the_source(pair: Pair, seed: int,
                                                             per_batch: int | None):
    run_against_source(pair, seed, per_batch=per_batch, restarts=per_batch is None)


@pytest.mark.parametrize("seed", fuzz.seeds())
def test_random_moves_applied_change_by_change_end_like_the_source(
        pair: Pair, seed: int, monkeypatch: pytest.MonkeyPatch):
    """Every table through the change-by-change path (as a conflict or REPLICA IDENTITY
    FULL would send it): its own reads, marks and reads again."""
    monkeypatch.setattr(plan_module.TablePlan, "reason", lambda self: "the test's choice")
    run_against_source(pair, seed, per_batch=None, restarts=False)
