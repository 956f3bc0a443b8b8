"""Filter preview: what a candidate row filter would replicate, on the real data.

Validation first (:func:`~.catalog.validate_filter`); then, for a valid filter, counts
and a sample in a READ ONLY transaction under a statement timeout (the steps of
:mod:`.evaluate`). A filter refused only because it uses columns outside the replica
identity while UPDATE/DELETE are published is measured too (``valid: false`` with its
errors, and the counts): the expression itself is sound — it validates in full for an
insert-only publication, PostgreSQL's own dry run included — and someone about to fix
their replica identity wants to see what the filter matches. Plain SELECTs take ACCESS
SHARE locks only, so writers are never blocked. Counting a big table exactly can take
long, so past ``exact_row_limit`` estimated rows, or when the exact count exceeds its
time budget, the counts come from a ``TABLESAMPLE SYSTEM`` sample scaled to the table's
current size (pages on disk times rows per page from the statistics), and ``estimated`` is
true; when the planner can count the matching rows without reading the table (an index
on a key range, exactly where a page sample is worst), that count is exact. The sample
rows come from the sampled pages first. Every step has its own statement timeout inside
one overall budget. Rows where the filter is NULL are counted apart: they are not
replicated, which people forget.

Nothing that happens while the filter is evaluated on the data is an exception for the
caller: a filter PostgreSQL cannot evaluate on some existing row (``100 / a > 1`` with
``a = 0``) makes the verdict invalid with ``filter_evaluation_error`` and PostgreSQL's
message (the walsender would fail the same way later); a step that runs out of time
degrades to an estimate or to missing counts with a ``preview_incomplete`` warning; when
not every row was evaluated, ``filter_evaluation_partial`` says so.

Only the filter text normalized by pglast (a single expression, re-parsed) and a quoted
table name are ever placed in SQL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.platform.errors import describe_error
from pgsieve.rowfilter.catalog import FilterValidation, validate_filter
from pgsieve.rowfilter.evaluate import (
    EvaluationFailed,
    StepCancelled,
    StepError,
    TableSize,
    count_query,
    evaluation_issue,
    read_only,
    run_step,
    sample_percent,
    scale_counts,
    table_size,
    tablesample,
)
from pgsieve.rowfilter.parse import FilterIssue, IssueCode, parse_table_name, quote_qualified
from pgsieve.rowfilter.rules import normalize_publish
from pgsieve.rowfilter.updates import unqualified_filter

DEFAULT_SAMPLE_SIZE = 10
MAX_SAMPLE_SIZE = 100
#: The sampled count reads a bounded number of pages; this is a safety net only.
SAMPLE_COUNT_TIMEOUT_MS = 30000


@dataclass(frozen=True)
class FilterPreview:
    validation: FilterValidation
    total_rows: int | None = None
    matching_rows: int | None = None
    null_rows: int | None = None
    sample: list[dict[str, Any]] = field(default_factory=list)
    estimated: bool = False
    #: the preview's own warnings (time budget, partial evaluation), after validation's
    notes: tuple[FilterIssue, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        v = self.validation.as_dict()
        warnings = v["warnings"]
        assert isinstance(warnings, list)
        return {
            "valid": v["valid"],
            "errors": v["errors"],
            "warnings": warnings + [{"code": str(i.code), "message": i.message}
                                    for i in self.notes],
            "replica_identity": v["replica_identity"],
            "normalized": v["normalized"],
            "total_rows": self.total_rows,
            "matching_rows": self.matching_rows,
            "null_rows": self.null_rows,
            "sample": self.sample,
            "estimated": self.estimated,
        }


def preview_filter(
    conn: psycopg.Connection[Any],
    table: str,
    where_text: str,
    publish: Iterable[str] | str | None = None,
    *,
    publish_via_partition_root: bool = False,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    exact_row_limit: int = 2_000_000,
    count_timeout_ms: int = 1500,
    sample_rows: int = 200_000,
    sample_timeout_ms: int = SAMPLE_COUNT_TIMEOUT_MS,
    columns: Sequence[str] | None = None,
    dry_run: bool = True,
) -> FilterPreview:
    """Validate ``where_text`` for ``table`` and, if valid — or refused only for the
    replica identity — measure it on the data (``dry_run``: see
    :func:`~.catalog.validate_filter`).

    ``publish_via_partition_root`` is the publication option the filter is meant for
    (a partitioned table's own filter needs it true; the counts then cover every
    partition). Raises only :class:`SourceConnectionError` (the connection was lost)."""
    validation = validate_filter(conn, table, where_text, publish, publish_via_partition_root,
                                 dry_run=dry_run)
    measurable = _measurable(conn, table, where_text, publish, publish_via_partition_root,
                             validation, dry_run)
    if measurable is not validation and measurable is not None:
        if measurable.valid:
            # the verdict stays the requested publication's; the expression's own
            # warnings (NULL handling, constants) still help read the counts
            validation = replace(validation, warnings=measurable.warnings)
        else:
            # what the replica-identity error had cut short found more wrong with it
            validation = replace(validation, errors=tuple(dict.fromkeys(
                (*validation.errors, *measurable.errors))))
    if measurable is None or not measurable.valid or measurable.normalized is None:
        return FilterPreview(validation)
    schema, name = parse_table_name(table)
    target = sql.Identifier(schema, name)
    # Only the pglast-normalized single expression (re-parsed by validation) gets here,
    # without column qualifiers: the sample query aliases the table.
    normalized = measurable.normalized
    if measurable.parsed is not None:
        normalized = unqualified_filter(measurable.parsed).normalized
    expr = sql.SQL(normalized)
    sample_size = max(0, min(sample_size, MAX_SAMPLE_SIZE))
    run = _Run(conn, target, expr, time.monotonic() + count_timeout_ms / 1000, columns)
    try:
        with read_only(conn):
            return run.measure(validation, schema, name, sample_size, exact_row_limit,
                               sample_rows, sample_timeout_ms)
    except EvaluationFailed as failure:
        issue = evaluation_issue(validation.table or quote_qualified(schema, name), failure)
        return FilterPreview(replace(validation, valid=False,
                                     errors=(*validation.errors, issue)))
    except psycopg.Error as exc:  # the final rollback failed, the connection is still open
        run.incomplete(f"the preview could not finish: {describe_error(exc)}")
        return FilterPreview(validation, notes=tuple(run.notes))


#: Errors that concern the publication the filter would be in, not the expression: a filter
#: refused only for these can still be evaluated on the table's rows.
_PUBLICATION_ONLY_ERRORS = frozenset({IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY})


def _measurable(
    conn: psycopg.Connection[Any],
    table: str,
    where_text: str,
    publish: Iterable[str] | str | None,
    publish_via_partition_root: bool,
    validation: FilterValidation,
    dry_run: bool = True,
) -> FilterValidation | None:
    """The validation of the expression to run on the rows: ``validation`` itself; for a
    filter refused only for its replica identity, the same filter validated for the
    operations that need none (insert, truncate), which also runs the checks the identity
    error cut short (objects resolved, PostgreSQL's dry run). Only a valid result is
    evaluated; None when nothing can be."""
    if validation.valid:
        return validation
    if validation.parsed is None or not validation.errors or any(
            e.code not in _PUBLICATION_ONLY_ERRORS for e in validation.errors):
        return None
    ops, _ = normalize_publish(publish)
    without_identity = sorted(ops - {"update", "delete"}) or ["insert"]
    return validate_filter(conn, table, where_text, without_identity,
                           publish_via_partition_root, dry_run=dry_run)


def _remaining_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


class _Run:
    """One preview's steps and the warnings they leave."""

    def __init__(self, conn: psycopg.Connection[Any], target: sql.Composable,
                 expr: sql.Composable, deadline: float,
                 columns: Sequence[str] | None = None) -> None:
        self.conn = conn
        self.columns = None if columns is None else list(columns)
        self.target = target
        self.expr = expr
        self.deadline = deadline
        self.notes: list[FilterIssue] = []

    def incomplete(self, message: str) -> None:
        self.notes.append(FilterIssue(IssueCode.PREVIEW_INCOMPLETE, message))

    def measure(
        self,
        validation: FilterValidation,
        schema: str,
        name: str,
        sample_size: int,
        exact_row_limit: int,
        sample_rows: int,
        sample_timeout_ms: int,
    ) -> FilterPreview:
        """The counts and the sample; EvaluationFailed propagates (the filter is at fault),
        every other failure of a step leaves a warning and a null count."""
        try:
            size = table_size(self.conn, schema, name)
        except (StepCancelled, StepError) as exc:
            self.incomplete(f"could not read the table's size, so nothing was counted: {exc}")
            return FilterPreview(validation, notes=tuple(self.notes))
        counts: tuple[int | None, int | None, int | None] | None = None
        percent: float | None = None
        if size.rows is None or size.rows <= exact_row_limit:
            counts = self._exact_counts(_remaining_ms(self.deadline))
        if counts is None:
            percent = sample_percent(size, sample_rows)
            counts = self._sampled_counts(size, percent, sample_timeout_ms)
            matching = self._cheap_exact_matching(size, min(_remaining_ms(self.deadline), 500))
            if matching is not None:
                total = counts[0]
                counts = (None if total is None else max(total, matching), matching, counts[2])
            self.notes.append(FilterIssue(
                IssueCode.EVALUATION_PARTIAL,
                "the counts come from a sample: the filter was not evaluated on every row, "
                "so rows on which PostgreSQL would fail to evaluate it (e.g. division by "
                "zero) may remain undetected",
            ))
        sample, cut_short = self._sample(sample_size, percent, _remaining_ms(self.deadline))
        if len(sample) < sample_size and percent is not None:
            # rare matches: look beyond the sampled pages while the budget lasts
            more, cut_short = self._sample(sample_size, None,
                                           max(_remaining_ms(self.deadline), 200))
            if len(more) > len(sample):
                sample = more
        if cut_short and not sample:
            self.incomplete("the sample rows could not be read within the time budget")
        total, matching_rows, nulls = counts
        return FilterPreview(validation, total, matching_rows, nulls, sample,
                             percent is not None, tuple(self.notes))

    def _exact_counts(self, timeout_ms: int) -> tuple[int, int, int] | None:
        """Exact counts, or None when they take longer than ``timeout_ms`` (or fail for a
        reason that is not the filter's; a sample is tried instead)."""
        try:
            rows = run_step(self.conn, count_query(self.target, self.expr), timeout_ms)
        except StepCancelled:
            return None
        except StepError as exc:
            self.incomplete(f"the exact count failed, estimating instead: {exc}")
            return None
        return int(rows[0][0]), int(rows[0][1]), int(rows[0][2])

    def _sampled_counts(
        self, size: TableSize, percent: float, timeout_ms: int
    ) -> tuple[int | None, int | None, int | None]:
        """Counts from about ``sample_rows`` rows on randomly chosen pages, scaled up; on
        a timeout only the planner's estimate of the total is left."""
        query = count_query(self.target, self.expr, tablesample(percent))
        try:
            rows = run_step(self.conn, query, timeout_ms)
        except (StepCancelled, StepError) as exc:
            self.incomplete(
                "the filter could not be counted on a sample of the table within the time "
                f"budget ({exc}); matching_rows and null_rows are unknown, total_rows is the "
                "planner's estimate")
            return size.rows, None, None
        return scale_counts(size, rows[0], percent)

    def _cheap_exact_matching(self, size: TableSize, timeout_ms: int) -> int | None:
        """The exact number of matching rows when the planner can find them without
        reading the table (e.g. an index on a key range, where a page sample is least
        accurate)."""
        query = sql.SQL("SELECT count(*) FROM {} WHERE ({})").format(self.target, self.expr)
        try:
            plan = run_step(self.conn, sql.SQL("EXPLAIN (FORMAT JSON) {}").format(query),
                            timeout_ms)
            doc = plan[0][0] if isinstance(plan[0][0], list) else json.loads(plan[0][0])
            cost = float(doc[0]["Plan"]["Total Cost"])
            rows = size.rows or 0
            full_scan = size.pages * 1.0 + rows * 0.0125  # seq_page_cost, cpu tuple+operator
            if full_scan <= 0 or cost > 0.1 * full_scan:
                return None
            counted = run_step(self.conn, query, timeout_ms)
        except (StepCancelled, StepError):
            return None
        return int(counted[0][0]) if counted else None

    def _sample(self, n: int, percent: float | None,
                timeout_ms: int) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``n`` matching rows; and whether the query was cut short."""
        if n == 0:
            return [], False
        # Only the published columns leave the source: the row is built from them alone.
        projection: sql.Composable = sql.SQL("t.*") if self.columns is None else sql.SQL(
            ", ").join(sql.SQL("t.{}").format(sql.Identifier(c)) for c in self.columns)
        if self.columns == []:
            projection = sql.SQL("")
        query = sql.SQL(
            "SELECT to_jsonb(r) FROM (SELECT {p} FROM {t} AS t{s} WHERE ({e}) LIMIT {n}) AS r"
        ).format(p=projection, t=self.target, e=self.expr, n=sql.Literal(n),
                 s=tablesample(percent) if percent is not None else sql.SQL(""))
        try:
            return [dict(r[0]) for r in run_step(self.conn, query, timeout_ms)], False
        except (StepCancelled, StepError):
            return [], True
