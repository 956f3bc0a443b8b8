"""Routing equals PostgreSQL's own evaluation, case by case (issue 58).

Three proofs against a real PostgreSQL 15:

1. The fast path's readers of text (int2/int4/int8, bool, uuid) accept exactly what the
   input functions accept, with the same value.
2. Random filters (drawn by Hypothesis) from the whole row-filter grammar
   (comparisons, IN, BETWEEN, IS NULL,
   boolean tests and operators, arithmetic, casts, functions, collations — "C", libc,
   ICU non-deterministic —, numeric and float with NaN, ±Infinity and -0, boundary
   integers) on random rows with NULLs: the router's decision (fast path or
   PostgreSQL path) equals ``(filter)`` evaluated by PostgreSQL on the table's row, and
   the fast path's three-valued result equals PostgreSQL's. Rows reach the router as a
   real pgoutput stream sends them.
3. The UPDATE rule: INSERT/UPDATE/DELETE workloads (key changes, unchanged TOAST values)
   through a real ``pgoutput`` slot — per filtered publication, what PostgreSQL emitted,
   operation by operation, equals what the router computes from the unfiltered stream.
"""

from __future__ import annotations

import os
import random
import uuid
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgsieve.routing import Operation, Router, RowChange, SubscriptionFilters, compile_filter
from pgsieve.routing.columns import parse_bool, parse_int, parse_uuid
from pgsieve.routing.pgeval import (
    FilterEvaluationError,
    PostgresFilterEvaluator,
    read_table_shape,
)
from pgsieve.routing.predicate import Row, RowReader
from pgsieve.routing.router import FilterCheck
from pgsieve.routing.shadow import RoutingDivergence, ShadowChecker
from tests.integration.routing_env import peek_changes

#: Fixed, so a failure reproduces; PGSIEVE_ROUTING_SEED explores further.
SEED = int(os.environ.get("PGSIEVE_ROUTING_SEED", "58"))

# -- 1. the readers of text ----------------------------------------------------------------

_TRY_CAST = """
CREATE FUNCTION try_cast(t text, typ text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE r text;
BEGIN
  EXECUTE format('SELECT (%L::%s)::text', t, typ) INTO r;
  RETURN r;
EXCEPTION WHEN others THEN RETURN NULL;
END $$
"""

_INT_FORMS = ["0", "7", "007", "-0", "+7", " 7", "7 ", "\t-12\n", "\v5\f", "1 2", "", " ",
              "+", "-", "0x1F", "1_000", "1e3", "1.0", "32767", "32768", "-32768", "-32769",
              "2147483647", "2147483648", "-2147483648", "-2147483649",
              "9223372036854775807", "9223372036854775808", "-9223372036854775808",
              "-9223372036854775809", "٣", "\u00a07", "7\u00a0", "--7", "+-7"]
_BOOL_FORMS = ["t", "f", "T", "F", "true", "TRUE", "tru", "tr", "truex", "false", "fa", "f ",
               " yes ", "y", "ye", "yess", "no", "n", "on", "ON", "o", "of", "off", "offf",
               "1", "0", "01", "10", "", " ", "\ttrue\n", "\vno\f", "ｔrue", "İ", "true\u00a0"]
_UUID_FORMS = ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
               "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}", "a0eebc999c0b4ef8bb6d6bb9bd380a11",
               "a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11", "{a0eebc999c0b4ef8bb6d6bb9bd380a11}",
               "a0eebc99-9c0b4ef8-bb6d6bb9-bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1",
               "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-", "-a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
               "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
               " a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11 ",
               "a0e-ebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "g0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
               "a0eebc99--9c0b-4ef8-bb6d-6bb9bd380a11", ""]


def test_text_readers_agree_with_the_input_functions(source_db: Any) -> None:
    rng = random.Random(SEED)
    alphabet = "0123456789+- \tabcdefABCDEF{}xX_."
    ints = _INT_FORMS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
                         for _ in range(300)]
    uuids = _UUID_FORMS + [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(20)]
    with source_db.connect() as conn:
        conn.execute(_TRY_CAST)
        for typ, oid in (("int2", 21), ("int4", 23), ("int8", 20)):
            for text in ints:
                pg = conn.execute("SELECT try_cast(%s, %s)", (text, typ)).fetchone()[0]
                ours = parse_int(text, oid)
                assert (None if ours is None else str(ours)) == pg, (typ, text)
        for text in _BOOL_FORMS:
            pg = conn.execute("SELECT try_cast(%s, 'bool')", (text,)).fetchone()[0]
            ours = parse_bool(text)
            assert (None if ours is None else str(ours).lower()) == pg, text
        for text in uuids:
            pg = conn.execute("SELECT try_cast(%s, 'uuid')", (text,)).fetchone()[0]
            ours = parse_uuid(text)
            assert (None if ours is None else str(uuid.UUID(int=ours))) == pg, text


# -- helpers: a real pgoutput stream -------------------------------------------------------


def _connect(source_db: Any) -> psycopg.Connection[Any]:
    """Decoding reads flushed WAL only, and the test cluster commits asynchronously."""
    conn: psycopg.Connection[Any] = source_db.connect()
    conn.execute("SET synchronous_commit = on")
    return conn


def _stream(conn: psycopg.Connection[Any], slot: str, publication: str
            ) -> list[tuple[str, str, Row | None, Row | None]]:
    """(table, kind, old, new) per change, as pgoutput sent them for ``publication``."""
    return peek_changes(conn, slot, [publication])


# -- 2. random filters, random rows ------------------------------------------------------

_INTS = ["0", "1", "-1", "7", "32767", "-32768", "2147483647", "-2147483648",
         "9223372036854775807", "-9223372036854775808"]
_TEXTS = ["abc", "ABC", "abc ", "", "b", "B", "ä", "Ä", "a", "ß", "ss"]
_UUIDS = ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "00000000-0000-0000-0000-000000000000",
          "ffffffff-ffff-ffff-ffff-ffffffffffff"]
_FLOATS = ["0", "-0", "NaN", "Infinity", "-Infinity", "0.1", "1", "-1.5", "1e300"]
_NUMERICS = ["0", "-0", "NaN", "0.1", "1.0", "1", "-1.5", "100000000000000000000.5"]


def _pick(rng: random.Random, values: list[str], null_rate: float = 0.15) -> str | None:
    return None if rng.random() < null_rate else rng.choice(values)


def _row(rng: random.Random, key: int) -> dict[str, str | None]:
    i8 = _pick(rng, _INTS)
    return {
        "id": str(key),
        "i2": _pick(rng, [v for v in _INTS if abs(int(v)) <= 32768 and int(v) != 32768]),
        "i4": _pick(rng, [v for v in _INTS if -(2**31) <= int(v) < 2**31]),
        "i8": i8, "b": _pick(rng, ["t", "f"]), "u": _pick(rng, _UUIDS),
        "tx": _pick(rng, _TEXTS), "tc": _pick(rng, _TEXTS), "vc": _pick(rng, _TEXTS),
        "tl": _pick(rng, _TEXTS), "tnd": _pick(rng, _TEXTS), "ti": _pick(rng, _TEXTS),
        "ch": _pick(rng, ["ab", "ab ", "a"]), "qc": _pick(rng, ["a", "é", "\\", "A"]),
        "n": _pick(rng, _NUMERICS), "f8": _pick(rng, _FLOATS),
        "f4": _pick(rng, ["0", "-0", "NaN", "0.1", "Infinity", "1"]),
    }


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class _Filters:
    """Random filters over the test table's columns, from the whole row-filter grammar."""

    def __init__(self, rng: random.Random, libc: str | None) -> None:
        self.rng = rng
        self.libc = libc

    def int_const(self) -> str:
        rng = self.rng
        value = rng.choice([*_INTS, "5000000000", "3", "-7"])
        form = rng.random()
        if form < 0.15:
            return _quote(rng.choice(["007", " 7 ", "+7", "-0", value]))
        if form < 0.2:
            return "NULL"
        if form < 0.25:
            return f"{_quote(value)}::int8"
        if form < 0.3:
            return rng.choice(["7.0", "1.5", "-0.0", "'NaN'::numeric"])
        return value if not value.startswith("-") else f"({value})"

    def atom(self) -> str:
        rng = self.rng
        kind = rng.randrange(9)
        if kind <= 2:
            col = rng.choice(["i2", "i4", "i8", "id"])
            form = rng.randrange(8)
            if form == 0:
                return f"{col} IN ({', '.join(self.int_const() for _ in range(rng.randint(1, 4)))})"
            if form == 1:
                return f"{col} NOT IN ({self.int_const()}, {self.int_const()})"
            if form == 2:
                return f"{col} BETWEEN {self.int_const()} AND {self.int_const()}"
            if form == 3:
                return rng.choice([f"{col} + 1 > 0", f"{col} % 2 = 0", f"abs({col}) = 1",
                                   f"{col}::text = '7'", f"-{col} < 0", f"{col} * 2 = {col}"])
            if form == 4:
                return f"{self.int_const()} {rng.choice(['=', '<', '>='])} {col}"
            op = rng.choice(["=", "=", "<>", "<", "<=", ">", ">="])
            return f"{col} {op} {self.int_const()}"
        if kind == 3:
            return rng.choice(["b", "NOT b", "b = 'yes'", "b = TRUE", "b <> 'f'", "b = 'of'",
                               "b IS TRUE", "b IS NOT FALSE", "b IS UNKNOWN", "b IN ('t', NULL)",
                               "b > false", "b = 1::boolean"])
        if kind == 4:
            value = rng.choice([*_UUIDS, _UUIDS[0].upper(), "{" + _UUIDS[0] + "}",
                                _UUIDS[0].replace("-", "")])
            return rng.choice([f"u = {_quote(value)}", f"u IN ({_quote(value)}, NULL)",
                               f"u < {_quote(value)}", f"u <> {_quote(value)}::uuid",
                               "u IS NULL", f"{_quote(value)} = u"])
        if kind in (5, 6):
            col = rng.choice(["tx", "tc", "vc", "tnd", "ti", "ch"]
                             + (["tl"] if self.libc else []))
            value = _quote(rng.choice([*_TEXTS, "ab", "AB"]))
            options = [f"{col} = {value}", f"{col} <> {value}", f"{col} IN ({value}, 'b')",
                       f"{col} < {value}", f"{col} >= {value}", f"{col} LIKE 'a%'",
                       f"lower({col}) = {value}", f'{col} = {value} COLLATE "C"',
                       f'{col} > {value} COLLATE "C"', f"{col} = {value}::text",
                       f'{col} = {value} COLLATE "und-x-icu"',
                       f'{col} < {value} COLLATE "und-x-icu"',
                       f"{col} BETWEEN 'a' AND 'b'", f"length({col}) = 3",
                       f"{col} IS NOT NULL", f"{col} ILIKE 'A%'"]
            if self.libc:
                options.append(f'{col} < {value} COLLATE "{self.libc}"')
            return rng.choice(options)
        if kind == 7 and rng.random() < 0.2:
            return rng.choice(["qc = 'a'", "qc = 'é'", "qc < 'b'", "qc = '\\'",
                               "qc::text = '\\303'"])
        if kind == 7:
            return rng.choice(["n = 1.0", "n = 'NaN'", "n > 0", "n = 0", "n = -0.0",
                               "n < 'NaN'", "n IN (0.1, 1)", "n::int4 = 1", "n = 1",
                               "n BETWEEN -1 AND 1", "round(n) = 0", "n IS NULL"])
        return rng.choice(["f8 = 'NaN'", "f8 = 0", "f8 = '-0'", "f8 > 'Infinity'",
                           "f8 >= 'Infinity'", "f8 < 1", "f8 = 0.1", "f4 = 0.1",
                           "f4 = 0.1::float4", "f8 = 'NaN'::float8", "f8 IN (0, 1)",
                           "f4 > f8", "f8 + 1 > f8", "f4 IS NOT NULL", "f8 = 1e300 * 10"])

    def filter(self, depth: int = 0) -> str:
        rng = self.rng
        roll = rng.random()
        if depth >= 2 or roll < 0.45:
            return self.atom()
        if roll < 0.65:
            return f"({self.filter(depth + 1)}) AND ({self.filter(depth + 1)})"
        if roll < 0.82:
            return f"({self.filter(depth + 1)}) OR ({self.filter(depth + 1)})"
        if roll < 0.9:
            return f"NOT ({self.filter(depth + 1)})"
        test = rng.choice(["IS TRUE", "IS NOT TRUE", "IS FALSE", "IS NOT FALSE", "IS UNKNOWN",
                           "IS NOT UNKNOWN", "IS NULL", "IS NOT NULL"])
        return f"({self.filter(depth + 1)}) {test}"


def _create_icu_collation(conn: psycopg.Connection[Any]) -> None:
    """The case-insensitive (non-deterministic) ICU collation ``ci``. The tests need a
    server built with ICU (Debian's PostgreSQL is, and CI runs it): non-deterministic
    collations are what a fast path must never take for bytewise equality, so a server
    without them fails here rather than passing without the case."""
    found = conn.execute("SELECT count(*) FROM pg_collation WHERE collprovider = 'i'"
                         ).fetchone()
    assert found and found[0], "these tests need a PostgreSQL built with ICU"
    conn.execute("CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', "
                 "deterministic = false)")


def _setup_types_table(conn: psycopg.Connection[Any]) -> str | None:
    """The table; returns a libc collation other than C/POSIX if the server has one."""
    _create_icu_collation(conn)
    libc_row = conn.execute(
        "SELECT collname FROM pg_collation WHERE collprovider = 'c' AND collencoding IN "
        "(-1, pg_char_to_encoding(current_setting('server_encoding'))) AND collname NOT IN "
        "('C', 'POSIX', 'ucs_basic') ORDER BY collname NOT LIKE 'en_US%', 1 LIMIT 1"
    ).fetchone()
    libc = str(libc_row[0]) if libc_row else None
    conn.execute(
        "CREATE TABLE t (id int4 PRIMARY KEY, i2 int2, i4 int4, i8 int8, b bool, u uuid, "
        'tx text, tc text COLLATE "C", vc varchar(10), '
        + (f'tl text COLLATE "{libc}", ' if libc else "tl text, ")
        + 'tnd text COLLATE ci, ti text COLLATE "und-x-icu", '
        + 'ch char(3), qc "char", n numeric, f8 float8, f4 float4)')
    return libc


def test_random_filters_route_as_postgres_evaluates(source_db: Any) -> None:
    """Hypothesis draws the filters (its Random is shrinkable: a failure shrinks to a
    small filter); the rows are seeded. Then all accepted filters at once, as one
    router's subscriptions, in one batch."""
    rng = random.Random(SEED)
    with _connect(source_db) as conn:
        libc = _setup_types_table(conn)
        conn.execute("CREATE PUBLICATION everything FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot('route_exact', 'pgoutput')")
        rows = [_row(rng, k) for k in range(80)]
        columns = list(rows[0])
        with conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO t ({', '.join(columns)}) VALUES "
                f"({', '.join(['%s'] * len(columns))})",
                [[r[c] for c in columns] for r in rows])
        images = [new for _, _, _, new in _stream(conn, "route_exact", "everything")
                  if new is not None]
        assert len(images) == len(rows)
        inserts = [RowChange("insert", new=image) for image in images]
        shape = read_table_shape(conn, "public", "t")
        evaluator = PostgresFilterEvaluator(conn, shape)
        seen = {"fast": 0, "postgres": 0, "rejected": 0, "raises": 0}
        accepted: dict[str, dict[str, bool | None]] = {}

        def check(text: str) -> None:
            try:
                with conn.transaction():
                    conn.execute(f"EXPLAIN SELECT ({text}) FROM t")
            except psycopg.Error:
                seen["rejected"] += 1  # PostgreSQL does not accept it: not a row filter
                return
            compiled = compile_filter(text, shape)
            try:
                with conn.transaction():
                    truth = dict(conn.execute(f"SELECT id::text, ({text}) FROM t").fetchall())
            except psycopg.Error:
                # raises on some row (overflow, …): the walsender would too; so must we
                assert not compiled.fast, text
                with pytest.raises(FilterEvaluationError):
                    Router(shape, [SubscriptionFilters("s", {"insert": text})]).route_batch(
                        inserts, evaluator)
                seen["raises"] += 1
                return
            seen["fast" if compiled.fast else "postgres"] += 1
            accepted[text] = truth
            if compiled.predicate is not None:  # the fast path's NULL is PostgreSQL's NULL
                for image in images:
                    assert compiled.predicate.evaluate(RowReader(image)) == truth[image["id"]], (
                        text, image)
            else:  # PostgreSQL's path, rebuilt from text, is exact too
                values = evaluator.evaluate([FilterCheck(compiled, image) for image in images])
                assert values == [truth[image["id"]] for image in images], text
            router = Router(shape, [SubscriptionFilters("s", {"insert": text}),
                                    SubscriptionFilters("all", {"insert": None})])
            for image, operations in zip(images, router.route_batch(inserts, evaluator),
                                         strict=True):
                expected = Operation.INSERT if truth[image["id"]] is True else None
                assert operations.get("s") == expected, (text, image)
                assert operations["all"] is Operation.INSERT

        # derandomized unless PGSIEVE_ROUTING_SEED asks to explore
        @settings(max_examples=int(os.environ.get("PGSIEVE_ROUTING_EXAMPLES", "250")),
                  deadline=None, derandomize="PGSIEVE_ROUTING_SEED" not in os.environ,
                  database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(st.randoms(use_true_random=False))
        def random_filter(draw: random.Random) -> None:
            check(_Filters(draw, libc).filter())

        random_filter()
        print("filters:", seen)
        assert seen["fast"] >= 40, seen
        assert seen["postgres"] >= 40, seen

        # every accepted filter a subscription of one router: one batch, one round trip
        texts = list(accepted)
        router = Router(shape, [SubscriptionFilters(str(i), {"insert": text})
                                for i, text in enumerate(texts)])
        before = evaluator.round_trips
        routed = router.route_batch(inserts, evaluator)
        assert evaluator.round_trips == before + 1
        for image, operations in zip(images, routed, strict=True):
            assert {int(s) for s in operations} == {
                i for i, text in enumerate(texts) if accepted[text][str(image["id"])] is True}


# -- 3. the UPDATE rule, against real publications ---------------------------------------

_KEYED_FILTERS = {
    "p_one": "tenant = 1",
    "p_some": "tenant IN (2, 3)",
    "p_eu": "region = 'eu' AND tenant <> 4",
    "p_even": "tenant > 1 AND id % 2 = 0",
    "p_not": "NOT (tenant = 2) OR region IS NULL",
}
_FULL_FILTERS = {
    "f_long": "length(big) > 5000",
    "f_kind": "kind = 'a'",
    "f_both": "kind = 'b' AND big IS NOT NULL AND amount > 10.5",
}


def _workload(conn: psycopg.Connection[Any], rng: random.Random) -> None:
    big = "SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 300)"
    keys: list[int] = []
    for step in range(260):
        roll = rng.random()
        if roll < 0.35 or len(keys) < 5:
            key = step + 1
            keys.append(key)
            conn.execute("INSERT INTO keyed VALUES (%s, %s, %s, %s)",
                         (key, rng.randint(1, 4), rng.choice(["eu", "us"]), rng.random()))
            conn.execute(f"INSERT INTO full_t VALUES (%s, %s, %s, "
                         f"CASE WHEN %s THEN ({big}) ELSE 'short' END)",
                         (key, rng.choice(["a", "b"]), rng.choice([1, 11, None]),
                          rng.random() < 0.5))
        elif roll < 0.55:
            conn.execute("UPDATE keyed SET amount = amount + 1 WHERE id = %s",
                         (rng.choice(keys),))
            conn.execute("UPDATE full_t SET kind = %s WHERE id = %s",
                         (rng.choice(["a", "b"]), rng.choice(keys)))
        elif roll < 0.8:
            conn.execute("UPDATE keyed SET tenant = %s, region = %s WHERE id = %s",
                         (rng.randint(1, 4), rng.choice(["eu", "us"]), rng.choice(keys)))
            conn.execute("UPDATE full_t SET amount = %s WHERE id = %s",
                         (rng.choice([1, 11, 20, None]), rng.choice(keys)))
        elif roll < 0.88:
            conn.execute(f"UPDATE full_t SET big = ({big}) WHERE id = %s", (rng.choice(keys),))
        else:
            key = keys.pop(rng.randrange(len(keys)))
            conn.execute("DELETE FROM keyed WHERE id = %s", (key,))
            conn.execute("DELETE FROM full_t WHERE id = %s", (key,))


def _identity(kind: str, old: Any, new: Any) -> tuple[str, str]:
    return kind, (new if new is not None else old)["id"]


def test_update_rule_matches_pgoutput(source_db: Any) -> None:
    rng = random.Random(SEED + 1)
    with _connect(source_db) as conn:
        conn.execute("CREATE TABLE keyed (id int4 NOT NULL, tenant int4 NOT NULL, "
                     "region text NOT NULL, amount float8)")
        conn.execute("CREATE UNIQUE INDEX keyed_ri ON keyed (tenant, region, id)")
        conn.execute("ALTER TABLE keyed REPLICA IDENTITY USING INDEX keyed_ri")
        conn.execute("CREATE TABLE full_t (id int4 PRIMARY KEY, kind text, amount numeric, "
                     "big text)")
        conn.execute("ALTER TABLE full_t ALTER big SET STORAGE EXTERNAL")
        conn.execute("ALTER TABLE full_t REPLICA IDENTITY FULL")
        conn.execute("CREATE PUBLICATION p_all FOR TABLE keyed, full_t")
        for name, where in _KEYED_FILTERS.items():
            conn.execute(f"CREATE PUBLICATION {name} FOR TABLE keyed WHERE ({where})")
        for name, where in _FULL_FILTERS.items():
            conn.execute(f"CREATE PUBLICATION {name} FOR TABLE full_t WHERE ({where})")
        conn.execute("SELECT pg_create_logical_replication_slot('route_rule', 'pgoutput')")
        _workload(conn, rng)

        unfiltered = _stream(conn, "route_rule", "p_all")
        kinds = {(table, kind, old is not None,
                  any(v is not None and not isinstance(v, str) for v in (new or {}).values()))
                 for table, kind, old, new in unfiltered}
        # the workload reached every case: key changes with an old image, updates
        # without one, and unchanged TOAST values in the new image
        assert ("keyed", "update", True, False) in kinds
        assert ("keyed", "update", False, False) in kinds
        assert ("full_t", "update", True, True) in kinds

        for table, filters in (("keyed", _KEYED_FILTERS), ("full_t", _FULL_FILTERS)):
            shape = read_table_shape(conn, "public", table)
            router = Router(shape, [SubscriptionFilters(name, dict.fromkeys(
                ("insert", "update", "delete"), where)) for name, where in filters.items()])
            changes = [RowChange(kind, new=new, old=old)  # type: ignore[arg-type]
                       for t, kind, old, new in unfiltered if t == table]
            evaluator = PostgresFilterEvaluator(conn, shape)
            routed = router.route_batch(changes, evaluator)
            assert evaluator.round_trips <= 1
            for name in filters:
                emitted = [_identity(kind, old, new)
                           for t, kind, old, new in _stream(conn, "route_rule", name)
                           if t == table]
                ours = [_identity(str(ops[name]), change.old, change.new)
                        for change, ops in zip(changes, routed, strict=True) if name in ops]
                assert ours == emitted, name
                assert {k for k, _ in ours} >= {"insert", "delete"}, name

            # and the shadow check, run over everything, finds nothing to say
            checker = ShadowChecker(rate=1.0, seed=SEED)
            assert checker.divergences(router, changes, evaluator) == []
        conn.execute("SELECT pg_drop_replication_slot('route_rule')")


def test_the_shadow_check_catches_a_wrong_fast_path(source_db: Any) -> None:
    """A router built on a wrong idea of the table (its case-insensitive collation taken
    for a deterministic one) routes 'ABC' away from ``name = 'abc'``; PostgreSQL says it
    matches, and the shadow check stops with routing_divergence."""
    with _connect(source_db) as conn:
        _create_icu_collation(conn)
        conn.execute("CREATE TABLE tenants_t (id int4 PRIMARY KEY, name text COLLATE ci)")
        shape = read_table_shape(conn, "public", "tenants_t")
        filters = [SubscriptionFilters("abc", {"insert": "name = 'abc'"})]
        honest = Router(shape, filters)
        assert not honest.indexes["insert"].fast  # non-deterministic: PostgreSQL decides
        wrong_shape = replace(shape, columns=tuple(
            replace(c, collation_deterministic=True) for c in shape.columns))
        wrong = Router(wrong_shape, filters)
        changes = [RowChange("insert", new={"id": str(i), "name": name})
                   for i, name in enumerate(["abc", "ABC", "x", None])]
        evaluator = PostgresFilterEvaluator(conn, shape)
        assert [ops.get("abc") for ops in honest.route_batch(changes, evaluator)] == [
            Operation.INSERT, Operation.INSERT, None, None]
        checker = ShadowChecker(rate=1.0)
        checker.check(honest, changes, evaluator)  # nothing fast to check: no divergence
        with pytest.raises(RoutingDivergence) as caught:
            checker.check(wrong, changes, evaluator)
        assert caught.value.code == "routing_divergence"
        [divergence] = caught.value.divergences
        assert divergence.row["name"] == "ABC"
        assert divergence.fast_matched is False
        assert divergence.postgres_value is True


def test_postgres_path_with_awkward_names_and_constant_filters(source_db: Any) -> None:
    """Quoted, mixed-case and colliding column names, qualified references and filters
    that read no column at all go through the PostgreSQL path unharmed."""
    with _connect(source_db) as conn:
        conn.execute('CREATE TABLE "Odd T" ("Id" int4 PRIMARY KEY, "pgsieve_ordinal" numeric, '
                     '"pgsieve_fid" text, "two words" float8)')
        shape = read_table_shape(conn, "public", "Odd T")
        evaluator = PostgresFilterEvaluator(conn, shape)
        rows: list[dict[str, str | None]] = [
            {"Id": "1", "pgsieve_ordinal": "1.5", "pgsieve_fid": "x", "two words": "NaN"},
            {"Id": "2", "pgsieve_ordinal": None, "pgsieve_fid": None, "two words": "-0"},
        ]
        filters = {
            "a": 'pgsieve_ordinal > 1',
            "b": '"two words" = 0 OR pgsieve_fid = \'x\'',
            "c": '"Odd T"."Id" = 2',
            "d": 'public."Odd T"."Id" + 0 = 1',
            "e": "1 = 1",
            "f": "NULL::bool",
            "g": '"two words" = \'NaN\'::float8 AND "Id" % 2 = 1',
        }
        router = Router(shape, [SubscriptionFilters(k, {"insert": v}) for k, v in filters.items()])
        routed = router.route_batch([RowChange("insert", new=r) for r in rows], evaluator)
        assert evaluator.round_trips == 1
        assert routed == [
            dict.fromkeys(["a", "b", "d", "e", "g"], Operation.INSERT),
            dict.fromkeys(["b", "c", "e"], Operation.INSERT),
        ]
