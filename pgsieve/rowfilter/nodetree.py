"""What a filter became in PostgreSQL's hands: the stored query tree of the probe view.

Why a module of its own: which function, operator, type or collation an expression calls
is PostgreSQL's decision (overloads, implicit casts, ``search_path``), so validation lets
PostgreSQL resolve the filter in a temporary view (:mod:`.dryrun`) and reads the view's
``pg_rewrite.ev_action`` — ``nodeToString`` text that names every object by OID and every
node by its tag. Reading that text is pure (no I/O), testable on its own, and the tags are
judged here against the nodes PostgreSQL's own row-filter walker accepts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from pgsieve.rowfilter.parse import FilterIssue, IssueCode

__all__ = ["NodeTreeFacts", "parse_node_tree", "tag_issues"]


@dataclass(frozen=True)
class NodeTreeFacts:
    """What a ``pg_node_tree`` (nodeToString output) of a filter expression contains."""

    node_tags: frozenset[str]
    function_oids: frozenset[int]
    operator_oids: frozenset[int]
    type_oids: frozenset[int]
    collation_oids: frozenset[int]


_FUNC_KEYS = ("funcid", "opfuncid", "aggfnoid", "winfnoid")
_OPER_KEYS = ("opno",)
_TYPE_KEYS = (
    "vartype", "consttype", "funcresulttype", "opresulttype", "resulttype", "minmaxtype",
    "casetype", "coalescetype", "array_typeid", "element_typeid", "row_typeid", "typeId",
    "type", "aggtype", "wintype", "paramtype",
)
_COLL_KEYS = (
    "varcollid", "constcollid", "funccollid", "opcollid", "inputcollid", "collOid",
    "resultcollid", "casecollid", "coalescecollid", "minmaxcollid", "arraycollid",
    "inputcollids", "collation",
)
_LIST_KEYS = ("opnos", "inputcollids")

# Nodes check_simple_rowfilter_expr_walker accepts (CASEWHEN is walked through, not checked).
_ALLOWED_TAGS = frozenset(
    {
        "VAR", "OPEXPR", "DISTINCTEXPR", "NULLIFEXPR", "SCALARARRAYOPEXPR", "ROWCOMPAREEXPR",
        "CONST", "FUNCEXPR", "BOOLEXPR", "RELABELTYPE", "COLLATEEXPR", "CASEEXPR",
        "CASEWHEN", "CASETESTEXPR", "ARRAYEXPR", "ROWEXPR", "COALESCEEXPR", "MINMAXEXPR",
        "XMLEXPR", "NULLTEST", "BOOLEANTEST",
    }
)
_TAG_ISSUES: dict[str, tuple[IssueCode, str]] = {
    "COERCEVIAIO": (
        IssueCode.UNSUPPORTED_EXPRESSION,
        "a cast in the filter converts through text input/output (e.g. integer::text or "
        "text::integer), which PostgreSQL does not allow in row filters",
    ),
    "ARRAYCOERCEEXPR": (
        IssueCode.UNSUPPORTED_EXPRESSION,
        "array casts that convert each element are not allowed in row filters",
    ),
    "SUBLINK": (IssueCode.SUBQUERY, "subqueries are not allowed in row filters"),
    "AGGREF": (IssueCode.AGGREGATE, "aggregate functions are not allowed in row filters"),
    "WINDOWFUNC": (IssueCode.WINDOW_FUNCTION, "window functions are not allowed in row filters"),
    "PARAM": (IssueCode.PARAMETER, "parameters are not allowed in row filters"),
    "SQLVALUEFUNCTION": (
        IssueCode.MUTABLE_FUNCTION,
        "CURRENT_DATE/CURRENT_USER-style values are not immutable",
    ),
}


def _sanitize(tree: str) -> str:
    """Neutralise backslash-escaped characters so names can never look like fields."""
    return re.sub(r"\\.", "_", tree)


def _balanced_after(text: str, start: int) -> str | None:
    """The ``{…}`` group beginning at ``start`` (text must be sanitized)."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def parse_node_tree(tree: str, *, quals_only: bool = True) -> NodeTreeFacts:
    """Extract node tags and referenced OIDs from PostgreSQL's nodeToString text.

    With ``quals_only`` the text is a view's ``ev_action`` and only the WHERE clause of its
    query (``:jointree … :quals {…}``) is examined; otherwise the whole text is.
    """
    text = _sanitize(tree)
    if quals_only:
        jt = text.find(" :jointree ")
        qpos = text.find(" :quals ", jt if jt >= 0 else 0)
        part = _balanced_after(text, qpos + len(" :quals ")) if qpos >= 0 else None
        text = part or ""

    def scalar(keys: Iterable[str]) -> frozenset[int]:
        found: set[int] = set()
        for key in keys:
            found.update(int(m) for m in re.findall(rf" :{key} (\d+)", text))
        return frozenset(o for o in found if o != 0)

    def listed(key: str) -> frozenset[int]:
        found: set[int] = set()
        for m in re.findall(rf" :{key} \(o ([\d ]*)\)", text):
            found.update(int(x) for x in m.split())
        return frozenset(o for o in found if o != 0)

    return NodeTreeFacts(
        node_tags=frozenset(re.findall(r"\{([A-Z_]+)", text)),
        function_oids=scalar(_FUNC_KEYS),
        operator_oids=scalar(_OPER_KEYS) | listed("opnos"),
        type_oids=scalar(_TYPE_KEYS),
        collation_oids=scalar(k for k in _COLL_KEYS if k not in _LIST_KEYS)
        | listed("inputcollids"),
    )


def tag_issues(tags: Iterable[str]) -> list[FilterIssue]:
    issues: list[FilterIssue] = []
    for tag in sorted(set(tags) - _ALLOWED_TAGS):
        code, message = _TAG_ISSUES.get(
            tag,
            (
                IssueCode.UNSUPPORTED_EXPRESSION,
                f"PostgreSQL turns part of this filter into a {tag} node, which row filters do "
                "not allow (only columns, constants, built-in operators and immutable built-in "
                "functions are)",
            ),
        )
        issues.append(FilterIssue(code, message))
    return issues
