"""Row-filter parsing (pglast, PostgreSQL's grammar) and the pure rules, without a database."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pglast.parser import scan

from pgsieve.rowfilter.nodetree import parse_node_tree
from pgsieve.rowfilter.parse import (
    MAX_FILTER_LENGTH,
    FilterIssue,
    FilterParseError,
    IssueCode,
    ParsedFilter,
    TableNameError,
    parse_filter,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.rules import (
    ColumnFacts,
    IndexFacts,
    PartitionFacts,
    ReplicaIdentity,
    ResolvedObject,
    TableFacts,
    column_list_issues,
    column_reference_issues,
    filter_warnings,
    normalize_publish,
    object_issues,
    partition_issues,
    publication_kind_issues,
    replica_identity_issues,
    table_issues,
)


def codes(parsed: ParsedFilter) -> set[str]:
    return {str(i.code) for i in parsed.issues}


def parse_error(text: str) -> tuple[str, int | None]:
    with pytest.raises(FilterParseError) as info:
        parse_filter(text)
    return str(info.value.issue.code), info.value.issue.position


# --------------------------------------------------------------------------------------
# accepted expressions


@pytest.mark.parametrize(
    ("text", "normalized", "columns"),
    [
        ("a > 1", "a > 1", {"a"}),
        ("a > 5 AND c = 'NSW'", "a > 5 AND c = 'NSW'", {"a", "c"}),
        ("  ((a)) >= 1  ", "a >= 1", {"a"}),
        ("A > 1", "a > 1", {"a"}),
        ('"Mixed" > 1', '"Mixed" > 1', {"Mixed"}),
        ("a IN (1, 2, 3)", "a IN (1, 2, 3)", {"a"}),
        ("b LIKE 'x%' OR b IS NULL", "b LIKE 'x%' OR b IS NULL", {"b"}),
        ("a BETWEEN 1 AND 10", "a BETWEEN 1 AND 10", {"a"}),
        ("a > 1 -- a comment with ) in it", "a > 1", {"a"}),
        ("a /* ) ; */ > 1", "a > 1", {"a"}),
        ("b = $$x); DROP TABLE t; --$$", "b = 'x); DROP TABLE t; --'", {"b"}),
        ("b = 'it''s'", "b = 'it''s'", {"b"}),
        # a backslash in a literal: E'' form, read the same whatever the session's
        # standard_conforming_strings (issue 17)
        ("b = E'a\\\\b'", "b = E'a\\\\b'", {"b"}),
        ("b = 'a\\b'", "b = E'a\\\\b'", {"b"}),
        ("b = 'it''s \\'", "b = E'it''s \\\\'", {"b"}),
        ("b = U&'\\0041'", "b = 'A'", {"b"}),
        ("true", "TRUE", set()),
        ("NOT flag", "NOT flag", {"flag"}),
        ("coalesce(a, 0) > 1", "COALESCE(a, 0) > 1", {"a"}),
        ("(a, b) < (1, 'x')", "(a, b) < (1, 'x')", {"a", "b"}),
        ("t.a > 1 AND public.t.b = 2", "t.a > 1 AND public.t.b = 2", {"a", "b"}),
        ("\"select\" = 1", '"select" = 1', {"select"}),
        ("comment = 'x'", "comment = 'x'", {"comment"}),
    ],
)
def test_accepted_expressions_are_normalized(text: str, normalized: str, columns: set[str]):
    parsed = parse_filter(text)
    assert parsed.ok, parsed.issues
    assert parsed.normalized == normalized
    assert parsed.columns == columns
    assert parsed.text == text
    # normalizing is idempotent
    assert parse_filter(parsed.normalized).normalized == normalized


def test_records_functions_operators_casts_collations():
    parsed = parse_filter(
        "lower(b) COLLATE \"C\" = 'x' AND a::bigint OPERATOR(pg_catalog.+) 1 > 2 "
        "AND pg_catalog.abs(a) < 3 AND d::timestamp[] IS NOT NULL"
    )
    assert parsed.functions == {"lower", "pg_catalog.abs"}
    assert {"=", ">", "<", "pg_catalog.+"} <= parsed.operators
    assert parsed.type_casts == {"pg_catalog.int8", "pg_catalog.timestamp[]"}
    assert parsed.collations == {"C"}
    assert parsed.null_aware  # IS NOT NULL


def test_qualified_column_references_keep_their_qualifiers():
    parsed = parse_filter("x.a > 1 AND s.t.b = 2 AND c = 3")
    refs = {(r.qualifiers, r.name) for r in parsed.column_refs}
    assert refs == {(("x",), "a"), (("s", "t"), "b"), ((), "c")}
    assert parsed.column_refs[0].position == 0
    assert parsed.column_refs[2].position == parsed.text.index("c =")


# --------------------------------------------------------------------------------------
# not a single expression / syntax


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "-- only a comment",
        "/* only a comment */",
        "true) ; DROP TABLE t; --",
        "true); DROP TABLE t; --",
        "a = 1;",
        "a = 1; SELECT 1",
        "1 FROM t",
        "1=1 UNION SELECT 1",
        "a > 1 b",
        "SELECT 1",
        "SELECT * FROM t WHERE a > 1",
        "DROP TABLE t",
        "WITH x AS (SELECT 1) SELECT 1",
        ")(",
        "a > 1) OR (true",
        "a) UNION (SELECT 1",
    ],
)
def test_not_single_expression(text: str):
    code, _ = parse_error(text)
    assert code == IssueCode.NOT_SINGLE_EXPRESSION


@pytest.mark.parametrize(
    "text",
    ["a > > 1", "a >", "(a > 1", "a = 'unterminated", "a /* unterminated", "b = $$x", "a = \"x",
     "a > 1 AND", "a = \x00 1", "a = '\ud800'"],
)
def test_syntax_errors(text: str):
    code, _ = parse_error(text)
    assert code == IssueCode.SYNTAX_ERROR


def test_error_positions_point_into_the_users_text():
    assert parse_error("a > 1 FROM t") == (IssueCode.NOT_SINGLE_EXPRESSION, 6)
    assert parse_error("a > > 1") == (IssueCode.SYNTAX_ERROR, 4)
    assert parse_error("true) ; DROP TABLE t") == (IssueCode.NOT_SINGLE_EXPRESSION, 4)
    assert parse_error("a = 1 ;") == (IssueCode.NOT_SINGLE_EXPRESSION, 6)


def test_size_limits():
    assert parse_error("a = " + "1" * MAX_FILTER_LENGTH)[0] == IssueCode.TOO_COMPLEX
    # a left-deep chain deep enough to crash pglast's tree conversion is refused up front
    assert parse_error("a" + "+a" * 50_000 + " > 1")[0] == IssueCode.TOO_COMPLEX
    assert parse_error("NOT " * 5000 + "true")[0] == IssueCode.TOO_COMPLEX


def test_non_text_is_a_type_error():
    with pytest.raises(TypeError):
        parse_filter(42)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# forbidden constructs recognisable from syntax


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("a > (SELECT 1)", IssueCode.SUBQUERY),
        ("EXISTS (SELECT 1 FROM t)", IssueCode.SUBQUERY),
        ("a IN (SELECT id FROM t)", IssueCode.SUBQUERY),
        ("a = ANY (ARRAY(SELECT 1))", IssueCode.SUBQUERY),
        ("count(*) > 1", IssueCode.AGGREGATE),
        ("sum(a) FILTER (WHERE a > 1) > 1", IssueCode.AGGREGATE),
        ("count(DISTINCT a) > 1", IssueCode.AGGREGATE),
        ("percentile_cont(0.5) WITHIN GROUP (ORDER BY a) > 1", IssueCode.AGGREGATE),
        ("GROUPING(a) = 1", IssueCode.AGGREGATE),
        ("row_number() OVER () > 1", IssueCode.WINDOW_FUNCTION),
        ("sum(a) OVER (PARTITION BY b) > 1", IssueCode.WINDOW_FUNCTION),
        ("a = $1", IssueCode.PARAMETER),
        ("ctid = '(0,1)'", IssueCode.SYSTEM_COLUMN),
        ("xmin = '1'", IssueCode.SYSTEM_COLUMN),
        ("t.xmax <> '0'", IssueCode.SYSTEM_COLUMN),
        ("cmin = 0 OR cmax = 0", IssueCode.SYSTEM_COLUMN),
        ("tableoid > 0", IssueCode.SYSTEM_COLUMN),
        ("d > CURRENT_TIMESTAMP", IssueCode.MUTABLE_FUNCTION),
        ("d > CURRENT_DATE", IssueCode.MUTABLE_FUNCTION),
        ("b = CURRENT_USER", IssueCode.MUTABLE_FUNCTION),
        ("b = SESSION_USER", IssueCode.MUTABLE_FUNCTION),
        ("d > LOCALTIMESTAMP(3)", IssueCode.MUTABLE_FUNCTION),
        ("c[1] = 2", IssueCode.UNSUPPORTED_EXPRESSION),
        ("(e).f = 2", IssueCode.UNSUPPORTED_EXPRESSION),
        ("a = DEFAULT", IssueCode.UNSUPPORTED_EXPRESSION),
        ("b IS JSON", IssueCode.UNSUPPORTED_EXPRESSION),
        ("t.* IS NOT NULL", IssueCode.WHOLE_ROW_REFERENCE),
        ("a.b.c.d.e = 1", IssueCode.INVALID_COLUMN_REFERENCE),
    ],
)
def test_forbidden_constructs_are_flagged(text: str, code: IssueCode):
    parsed = parse_filter(text)
    assert code in codes(parsed)
    assert not parsed.ok


def test_flags_and_positions_of_forbidden_constructs():
    parsed = parse_filter("a > 1 AND ctid = '(0,1)' AND b = $1")
    assert parsed.system_columns == {"ctid"}
    assert parsed.has_parameter
    by_code = {i.code: i.position for i in parsed.issues}
    assert by_code[IssueCode.SYSTEM_COLUMN] == 10
    assert by_code[IssueCode.PARAMETER] == 33
    assert parse_filter("max(a) OVER () > 1").has_window_function
    assert parse_filter("a > (SELECT 1)").has_subquery
    assert parse_filter("count(*) > 1").has_aggregate
    assert parse_filter("d > CURRENT_DATE").sql_value_functions == {"CURRENT_DATE"}


def test_now_is_left_to_the_catalog():
    # now() is an ordinary function call syntactically; its volatility is a catalog fact.
    parsed = parse_filter("d > now()")
    assert parsed.ok
    assert parsed.functions == {"now"}


# --------------------------------------------------------------------------------------
# table names


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("public.t1", ("public", "t1")),
        ("t1", ("public", "t1")),
        ("S.T", ("s", "t")),
        ('"My Schema"."My.Table"', ("My Schema", "My.Table")),
        ('  app . "Orders" ', ("app", "Orders")),
    ],
)
def test_parse_table_name(text: str, expected: tuple[str, str]):
    assert parse_table_name(text) == expected
    assert parse_table_name(quote_qualified(*expected)) == expected


@pytest.mark.parametrize(
    "text",
    ["", "db.s.t", "t; DROP TABLE x", "t WHERE true", "ONLY t", "t x", "t ORDER BY 1", "(t)",
     "t, u", "'t'", "t\x00"],
)
def test_bad_table_names(text: str):
    with pytest.raises(TableNameError):
        parse_table_name(text)


# --------------------------------------------------------------------------------------
# fuzzing the parser

_FRAGMENTS = st.sampled_from(
    [
        "a", "b", "t.a", "1", "'x'", "$$y$$", "E'\\''", "(", ")", ";", "--", "/*", "*/", "AND",
        "OR", "NOT", "=", ">", "<>", "SELECT", "FROM", "UNION", "DROP TABLE t", "$1", "::int",
        "COLLATE \"C\"", "IN", ",", "true", "NULL", "IS", "\n", " ", "'", '"', "\\", "[1]",
        "count(*)", "OVER ()", "now()", "ctid", "ARRAY[", "]", "CASE WHEN", "THEN", "END",
    ]
)


def _balanced_outside_strings(text: str) -> bool:
    depth = 0
    for tok in scan(text):
        if tok.name == "ASCII_59":
            return False
        if tok.name == "ASCII_40":
            depth += 1
        elif tok.name == "ASCII_41":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=80), st.lists(_FRAGMENTS, max_size=14).map(" ".join)))
def test_fuzz_parser_never_raises_unexpectedly(text: str):
    issue: FilterIssue | None
    try:
        parsed = parse_filter(text)
    except FilterParseError as exc:
        issue = exc.issue
    else:
        issue = None
    if issue is not None:
        assert issue.code in set(IssueCode)
        assert issue.position is None or 0 <= issue.position <= len(text)
        return
    # Whatever is accepted normalizes to one balanced expression with no terminator, and
    # normalizing again is a fixed point.
    assert _balanced_outside_strings(parsed.normalized)
    again = parse_filter(parsed.normalized)
    assert again.normalized == parsed.normalized
    assert again.columns == parsed.columns
    assert codes(again) == codes(parsed)


# --------------------------------------------------------------------------------------
# pure rules


def _table(identity: ReplicaIdentity | None = None, **kw: object) -> TableFacts:
    cols = (
        ColumnFacts("id", 1, "integer", 23, True),
        ColumnFacts("a", 2, "integer", 23, True),
        ColumnFacts("b", 3, "text", 25, False),
        ColumnFacts("g", 4, "integer", 23, False, generated=True),
        ColumnFacts("Mixed", 5, "integer", 23, False),
    )
    defaults: dict[str, object] = {
        "schema": "public",
        "name": "t",
        "columns": cols,
        "replica_identity": identity or ReplicaIdentity("default", ("id",), "t_pkey"),
        "indexes": (
            IndexFacts("t_pkey", ("id",), primary=True, usable_as_identity=True),
            IndexFacts("t_a_id_key", ("a", "id"), usable_as_identity=True),
        ),
        "database": "src",
    }
    defaults.update(kw)
    return TableFacts(**defaults)  # type: ignore[arg-type]


def issue_codes(issues: list[FilterIssue]) -> list[str]:
    return [str(i.code) for i in issues]


def test_unknown_and_badly_qualified_columns():
    t = _table()
    issues = column_reference_issues(
        parse_filter("nope > 1 AND mixed = 1 AND x.a = 1 AND src.public.t.a = 1 AND t = t"), t
    )
    assert issue_codes(issues) == [
        IssueCode.UNKNOWN_COLUMN,
        IssueCode.UNKNOWN_COLUMN,
        IssueCode.INVALID_COLUMN_REFERENCE,
        IssueCode.WHOLE_ROW_REFERENCE,
    ]
    assert '"Mixed"' in issues[1].message
    assert issues[0].position == 0
    assert column_reference_issues(parse_filter("t.a = 1 AND public.t.id = 1"), t) == []


@pytest.mark.parametrize(
    ("identity", "text", "publish", "bad"),
    [
        (ReplicaIdentity("default", ("id",), "t_pkey"), "id > 1", {"update"}, False),
        (ReplicaIdentity("default", ("id",), "t_pkey"), "a > 1", {"update"}, True),
        (ReplicaIdentity("default", ("id",), "t_pkey"), "a > 1", {"delete"}, True),
        (ReplicaIdentity("default", ("id",), "t_pkey"), "a > 1", {"insert", "truncate"}, False),
        (ReplicaIdentity("default", (), None), "id > 1", {"update"}, True),
        (ReplicaIdentity("index", ("a", "id"), "ix"), "a > 1 AND id < 5", {"delete"}, False),
        (ReplicaIdentity("index", ("a", "id"), "ix"), "b = 'x'", {"delete"}, True),
        (ReplicaIdentity("full", ("id", "a", "b")), "b = 'x'", {"update", "delete"}, False),
        (ReplicaIdentity("nothing"), "id > 1", {"update"}, True),
        (ReplicaIdentity("nothing"), "true", {"update"}, False),
    ],
)
def test_replica_identity_rule(identity, text, publish, bad):
    issues = replica_identity_issues(parse_filter(text), _table(identity), publish)
    assert issue_codes(issues) == ([IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY] if bad else [])


def test_replica_identity_message_says_what_would_allow_it():
    issues = replica_identity_issues(parse_filter("a > 1 AND b = 'x'"), _table(), {"update"})
    (issue,) = issues
    assert "REPLICA IDENTITY FULL" in issue.message
    assert "(a, b)" in issue.message
    assert "primary key (id)" in issue.message
    only_a = replica_identity_issues(parse_filter("a > 1"), _table(), {"delete"})[0]
    assert "existing candidate: t_a_id_key" in only_a.message


def test_replica_identity_of_each_leaf_when_publishing_via_root():
    leaves = (
        PartitionFacts("public", "p1", ReplicaIdentity("default", ("id",), "p1_pkey"), ("id", "a")),
        PartitionFacts("public", "p2", ReplicaIdentity("full", ("id", "a")), ("id", "a")),
    )
    root = _table(relkind="p", partitions=leaves)
    issues = replica_identity_issues(parse_filter("a > 1"), root, {"update"}, True)
    assert len(issues) == 1
    assert "public.p1" in issues[0].message
    assert partition_issues(root, False)[0].code == IssueCode.ON_PARTITIONED_TABLE
    assert partition_issues(root, True) == []


def test_object_issues():
    objs = [
        ResolvedObject("function", 1299, "now()", "s", "f"),
        ResolvedObject("function", 1598, "random()", "v", "f"),
        ResolvedObject("function", 870, "lower(text)", "i", "f"),
        ResolvedObject("function", 2147, "count(*)", "i", "a"),
        ResolvedObject("function", 3100, "row_number()", "i", "w"),
        ResolvedObject("function", 1067, "generate_series(integer,integer)", "i", "f", True),
        ResolvedObject("function", 16500, "public.myf(integer)", "i", "f"),
        ResolvedObject("operator", 16501, "public.===(integer,integer)"),
        ResolvedObject("type", 16502, "mood"),
        ResolvedObject("collation", 16503, "public.mycoll"),
        ResolvedObject("operator", 96, "=(integer,integer)"),
        ResolvedObject("type", 23, "integer"),
        ResolvedObject("collation", 950, "pg_catalog.\"C\""),
    ]
    assert sorted(issue_codes(object_issues(objs))) == sorted(
        [
            IssueCode.MUTABLE_FUNCTION,
            IssueCode.MUTABLE_FUNCTION,
            IssueCode.AGGREGATE,
            IssueCode.WINDOW_FUNCTION,
            IssueCode.SET_RETURNING_FUNCTION,
            IssueCode.USER_DEFINED_OBJECT,
            IssueCode.USER_DEFINED_OBJECT,
            IssueCode.USER_DEFINED_OBJECT,
            IssueCode.USER_DEFINED_OBJECT,
        ]
    )


def test_warnings():
    t = _table()
    w = issue_codes(filter_warnings(parse_filter("b = 'x'"), t, {"insert"}))
    assert w == [IssueCode.NULLABLE_COLUMN]
    assert filter_warnings(parse_filter("b IS NOT DISTINCT FROM 'x'"), t, {"insert"}) == []
    assert filter_warnings(parse_filter("a > 1"), t, {"insert"}) == []
    const = filter_warnings(parse_filter("1 = 2"), t, {"insert"}, False)
    assert issue_codes(const) == [IssueCode.CONSTANT_FILTER]
    assert "nothing will be replicated" in const[0].message
    always = filter_warnings(parse_filter("true"), t, {"insert"}, True)
    assert "same as no filter" in always[0].message
    no_ri = _table(ReplicaIdentity("default", (), None))
    w = issue_codes(filter_warnings(parse_filter("true"), no_ri, {"insert", "update", "truncate"}))
    assert IssueCode.REPLICA_IDENTITY_MISSING in w
    assert IssueCode.TRUNCATE_NOT_FILTERED in w


def test_publish_and_kind_arguments():
    assert normalize_publish(None)[0] == {"insert", "update", "delete", "truncate"}
    assert normalize_publish("insert, UPDATE") == (frozenset({"insert", "update"}), [])
    ops, issues = normalize_publish(["insert", "upsert"])
    assert ops == {"insert"}
    assert issue_codes(issues) == [IssueCode.INVALID_PUBLISH_OPERATION]
    assert publication_kind_issues("tables", "filter") == []
    assert publication_kind_issues("all_tables", "filter")[0].code == (
        IssueCode.NOT_ALLOWED_FOR_PUBLICATION_KIND
    )
    assert publication_kind_issues("schemas", "columns")[0].code == (
        IssueCode.COLUMN_LIST_NOT_ALLOWED_FOR_PUBLICATION_KIND
    )
    assert publication_kind_issues("views", "filter")[0].code == IssueCode.INVALID_PUBLICATION_KIND


def test_table_issues():
    assert table_issues(_table()) == []
    for kw in ({"relkind": "v"}, {"persistence": "u"}, {"persistence": "t"}, {"is_system": True}):
        assert issue_codes(table_issues(_table(**kw))) == [IssueCode.TABLE_NOT_PUBLISHABLE]


@pytest.mark.parametrize(
    ("identity", "columns", "publish", "expected"),
    [
        (None, ["id", "a"], None, []),
        (None, ["a"], None, [IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY]),
        (None, ["a"], ["insert"], []),
        (None, ["id", "id"], ["insert"], [IssueCode.COLUMN_LIST_DUPLICATE_COLUMN]),
        (None, ["id", "nope"], ["insert"], [IssueCode.COLUMN_LIST_UNKNOWN_COLUMN]),
        (None, ["id", "ctid"], ["insert"], [IssueCode.COLUMN_LIST_SYSTEM_COLUMN]),
        (None, ["id", "g"], ["insert"], [IssueCode.COLUMN_LIST_GENERATED_COLUMN]),
        (None, [], ["insert"], [IssueCode.COLUMN_LIST_EMPTY]),
        (
            ReplicaIdentity("full", ("id", "a", "b", "g", "Mixed")),
            ["id", "a", "b", "Mixed"],
            ["update"],
            [IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY],
        ),
        (ReplicaIdentity("full", ("id", "a")), ["id"], ["insert"], []),
        (ReplicaIdentity("index", ("a", "id"), "t_a_id_key"), ["a", "id"], ["delete"], []),
        (
            ReplicaIdentity("index", ("a", "id"), "t_a_id_key"),
            ["id"],
            ["delete"],
            [IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY],
        ),
    ],
)
def test_column_list_rules(identity, columns, publish, expected):
    assert issue_codes(column_list_issues(_table(identity), columns, publish)) == expected


def test_column_list_on_partitioned_table_and_schema_publications():
    root = _table(relkind="p")
    assert issue_codes(column_list_issues(root, ["id", "a"], ["insert"], False)) == [
        IssueCode.COLUMN_LIST_ON_PARTITIONED_TABLE
    ]
    assert column_list_issues(root, ["id", "a"], ["insert"], True) == []
    assert issue_codes(column_list_issues(_table(), ["id"], ["insert"], False, "schemas")) == [
        IssueCode.COLUMN_LIST_NOT_ALLOWED_FOR_PUBLICATION_KIND
    ]


def test_parse_node_tree_reads_only_the_where_clause_and_ignores_escaped_names():
    tree = (
        "({QUERY :commandType 1 :rtable ({RANGETBLENTRY :eref {ALIAS :aliasname t "
        ':colnames ("x\\ :funcid\\ 99" "a")} :relid 16450}) '
        ":jointree {FROMEXPR :fromlist ({RANGETBLREF :rtindex 3}) :quals {BOOLEXPR :boolop and "
        ":args ({OPEXPR :opno 521 :opfuncid 147 :opresulttype 16 :opretset false :opcollid 0 "
        ":inputcollid 0 :args ({VAR :varno 3 :varattno 2 :vartype 23 :varcollid 0} "
        "{FUNCEXPR :funcid 1299 :funcresulttype 1184 :funccollid 0 :inputcollid 0 :args <>})} "
        "{ROWCOMPAREEXPR :rctype 1 :opnos (o 97 664) :opfamilies (o 1976 1994) "
        ":inputcollids (o 0 100) :largs <> :rargs <>} {COERCEVIAIO :arg <> :resulttype 25 "
        ":resultcollid 100})}} :targetList ({TARGETENTRY :expr {CONST :consttype 23}})}"
    )
    facts = parse_node_tree(tree)
    assert facts.function_oids == {147, 1299}
    assert facts.operator_oids == {521, 97, 664}
    assert facts.type_oids == {16, 23, 1184, 25}
    assert facts.collation_oids == {100}
    assert facts.node_tags == {"BOOLEXPR", "OPEXPR", "VAR", "FUNCEXPR", "ROWCOMPAREEXPR",
                               "COERCEVIAIO"}
    assert 99 not in parse_node_tree(tree, quals_only=False).function_oids
