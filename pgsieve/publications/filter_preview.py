"""Row filters tried on a registered source: the filter preview with what the stored
publications and a subscription's recorded UPDATEs add to it, and the effective filters
of several publications — apart from HTTP.

The preview itself (validation, counts, sample) is :mod:`pgsieve.rowfilter.preview`, the
pure filter logic's; this module adds what needs the metadata store and the source
catalog, which the row-filter layer may not read: the filter a stored publication has for
a table (the only preview a viewer may run), the columns the sample may show (the named
publication's column list, as the catalog has it), and Table 31.1 over the subscription's
recent UPDATEs. The router (:mod:`pgsieve.api.routers.filters`) checks roles, parses the
request and withholds row data from a viewer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.platform.errors import ErrorCode, Unprocessable, Unreachable
from pgsieve.platform.lookups import load_subscription
from pgsieve.platform.models import UPDATE_IMAGE_WINDOW, Source, Subscription, UpdateImage
from pgsieve.platform.models import Publication as PublicationRow
from pgsieve.platform.settings import Settings
from pgsieve.publications.catalog import (
    catalog_snapshot,
    publication_exists,
    published_attnames,
    read_live_publications,
    read_publications,
    read_tables,
)
from pgsieve.rowfilter.effective import effective_filters
from pgsieve.rowfilter.facts import read_table_facts
from pgsieve.rowfilter.parse import (
    FilterParseError,
    TableNameError,
    parse_filter,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.preview import SAMPLE_COUNT_TIMEOUT_MS, FilterPreview, preview_filter
from pgsieve.rowfilter.probe import SourceConnectionError
from pgsieve.rowfilter.rules import normalize_publish
from pgsieve.rowfilter.updates import RowImages, evaluate_updates

#: No evaluation of a candidate filter over the recorded UPDATEs may take longer.
UPDATE_PREVIEW_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class PreviewRequest:
    """What to preview (the request body, in the domain's terms)."""

    table: str
    where: str
    publish: Sequence[str] | None
    publish_via_partition_root: bool
    sample_size: int
    examples: int
    update_window: int
    publication: str | None
    columns: list[str] | None
    subscription_id: str | None


@dataclass(frozen=True)
class StoredFilter:
    """The filter, operations and option of the publication pgsieve stores, for a table."""

    where: str
    publish: list[str]
    publish_via_partition_root: bool


class NeedsOperator(Exception):
    """The preview asked for needs the operator role (the router says so, as a 403)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# --------------------------------------------------------------------------------------
# the filter to preview


def stored_filter(session: Session, source_id: str, *, table: str, where: str | None,
                  publication: str | None, viewer: bool) -> StoredFilter | None:
    """The filter to run in place of the request's: None to run it as given (operator and
    up, with ``where``), or the filter, ``publish`` and ``publish_via_partition_root`` of
    the publication pgsieve stores for the source under ``publication`` — the only preview
    a viewer may run: what is published already, not a filter of its choosing (which
    could read any column of any table, a comparison at a time)."""
    if where is not None and not viewer:
        return None
    if publication is None:
        if viewer:
            raise NeedsOperator("previewing a new filter")
        raise Unprocessable("give `where`, or name a stored publication in `publication`",
                            code=ErrorCode.VALIDATION_ERROR, field="where")
    pub = session.scalar(select(PublicationRow).where(PublicationRow.source_id == source_id,
                                                      PublicationRow.name == publication))
    if pub is None:
        raise Unprocessable(f"pgsieve stores no publication '{publication}' for this "
                            "source", code=ErrorCode.PUBLICATION_NOT_FOUND, field="publication")
    try:
        wanted = quote_qualified(*parse_table_name(table))
    except TableNameError as exc:
        raise Unprocessable(str(exc), code=ErrorCode.INVALID_TABLE_NAME, field="table") from None
    entry = next((t for t in pub.tables if _canonical(t.table_name) == wanted), None)
    if entry is None and not (pub.all_tables or parse_table_name(table)[0] in pub.schemas):
        raise Unprocessable(f"publication '{pub.name}' does not publish {table}",
                            code=ErrorCode.TABLE_NOT_IN_PUBLICATION, field="table")
    stored = entry.where if entry is not None else None
    if viewer and where is not None and not _same_filter(where, stored):
        raise NeedsOperator("previewing a filter the publication does not have")
    return StoredFilter(stored or "true", list(pub.publish), pub.publish_via_partition_root)


def _same_filter(given: str, stored: str | None) -> bool:
    """Whether ``given`` is ``stored`` as PostgreSQL's grammar reads them."""
    if stored is None:
        return False
    try:
        return parse_filter(given).normalized == parse_filter(stored).normalized
    except FilterParseError:
        return False


def _canonical(name: str) -> str | None:
    try:
        return quote_qualified(*parse_table_name(name))
    except TableNameError:
        return None


def preview_subscription(session: Session, source: Source,
                         subscription_id: str | None) -> Subscription | None:
    """The subscription whose recorded UPDATEs the preview evaluates (it must read this
    source)."""
    if subscription_id is None:
        return None
    sub = load_subscription(session, subscription_id)
    if sub.source_id != source.id:
        raise Unprocessable(
            f"subscription '{sub.name}' reads another source", field="subscription_id",
            code=ErrorCode.SUBSCRIPTION_SOURCE_MISMATCH)
    return sub


# --------------------------------------------------------------------------------------
# the preview


def run_preview(
    conn: psycopg.Connection[Any],
    session: Session,
    settings: Settings,
    sub: Subscription | None,
    request: PreviewRequest,
    *,
    rows_allowed: bool,
) -> dict[str, Any]:
    """The preview's response body: the verdict, counts and sample, the
    ``update_transformations`` over ``sub``'s recent UPDATEs, and ``sample_columns``.
    Without ``rows_allowed`` no dry run runs on the source and every column is read (the
    caller withholds the rows)."""
    try:
        columns = _sample_columns(conn, request) if rows_allowed else None
        preview = preview_filter(
            conn,
            request.table,
            request.where,
            request.publish,
            publish_via_partition_root=request.publish_via_partition_root,
            sample_size=request.sample_size,
            exact_row_limit=settings.preview_exact_row_limit,
            # no step of a preview may outlast the control-plane statement timeout,
            # whatever the filter costs per row (repeat(note, 100000000) …)
            count_timeout_ms=min(1500, settings.statement_timeout_ms),
            sample_timeout_ms=min(SAMPLE_COUNT_TIMEOUT_MS, settings.statement_timeout_ms),
            columns=columns,
            dry_run=rows_allowed,
        )
        updates = (_update_transformations(conn, session, sub, request, preview)
                   if sub is not None else None)
        if updates is not None and columns is not None:
            for shown in updates.get("examples", {}).values():
                for example in shown:
                    example["old"] = _only(columns, example.get("old"))
                    example["new"] = _only(columns, example.get("new"))
    except SourceConnectionError as exc:
        raise Unreachable(f"lost the connection to the source: {exc}") from None
    except TableNameError as exc:  # pragma: no cover - the verdict already refused it
        raise Unprocessable(str(exc), code=ErrorCode.INVALID_TABLE_NAME) from None
    return {**preview.as_dict(), "update_transformations": updates,
            "sample_columns": columns}


def _only(columns: list[str] | None, image: Any) -> Any:
    if columns is None or not isinstance(image, dict):
        return image
    return {k: v for k, v in image.items() if k in columns}


def _sample_columns(conn: psycopg.Connection[Any], request: PreviewRequest) -> list[str] | None:
    """The columns the sample may show: the named publication's column list for the table
    (as the source catalog has it), narrowed to ``request.columns``; None: every column."""
    if request.publication is None and request.columns is None:
        return None
    try:
        schema, name = parse_table_name(request.table)
    except TableNameError:
        return None  # the verdict refuses the table name; no sample is taken
    facts = read_table_facts(conn, request.table)
    if facts is None:
        return None  # the verdict says the table does not exist
    existing = [c.name for c in facts.columns]
    published: list[str] | None = None
    if request.publication is not None:
        if not publication_exists(conn, request.publication):
            raise Unprocessable(f"the source has no publication '{request.publication}'",
                                code=ErrorCode.PUBLICATION_NOT_FOUND, field="publication")
        published = published_attnames(conn, request.publication, schema, name)
        if published is None:
            raise Unprocessable(
                f"publication '{request.publication}' does not publish {request.table}",
                code=ErrorCode.TABLE_NOT_IN_PUBLICATION, field="publication")
    if request.columns is None:
        return published
    unknown = [c for c in request.columns if c not in existing]
    if unknown:
        raise Unprocessable(f"{request.table} has no column {', '.join(unknown)}",
                            code=ErrorCode.UNKNOWN_COLUMN, field="columns", columns=unknown)
    if published is not None:
        hidden = [c for c in request.columns if c not in published]
        if hidden:
            raise Unprocessable(
                f"publication '{request.publication}' does not publish column(s) "
                f"{', '.join(hidden)}", code=ErrorCode.COLUMN_NOT_PUBLISHED, field="columns",
                columns=hidden)
    return list(dict.fromkeys(request.columns))


# --------------------------------------------------------------------------------------
# a subscription's recorded UPDATEs


def _recent_images(session: Session, sub: Subscription, table: str,
                   window: int) -> list[RowImages]:
    schema, name = parse_table_name(table)
    # the consumer records "schema.name" as PostgreSQL names it (unquoted)
    names = {f"{schema}.{name}", quote_qualified(schema, name)}
    rows = session.scalars(
        select(UpdateImage)
        .where(UpdateImage.subscription_id == sub.id, UpdateImage.table_name.in_(names))
        .order_by(UpdateImage.lsn.desc(), UpdateImage.id.desc())
        .limit(window)
    ).all()
    return [RowImages(r.lsn, r.old_kind, r.old, r.new) for r in reversed(rows)]


def _recorded_through(
    conn: psycopg.Connection[Any], sub: Subscription, table: str
) -> tuple[bool, str | None]:
    """Whether the subscription's publications (as the catalog has them now) send UPDATEs
    of ``table`` at all, and the filter those UPDATEs pass (None: every row)."""
    names = [str(n) for n in dict.fromkeys(sub.publications or [])]
    with catalog_snapshot(conn):
        live = read_live_publications(conn, names, with_published=False)
        tables = read_tables(conn)
    pubs = [live[n].definition for n in names if n in live]
    for item in effective_filters(pubs, tables):
        if table in (item.table, item.published_as) and "update" in item.filters:
            return True, item.filters["update"]
    return False, None


def _update_transformations(
    conn: psycopg.Connection[Any],
    session: Session,
    sub: Subscription,
    request: PreviewRequest,
    preview: FilterPreview,
) -> dict[str, Any] | None:
    validation = preview.validation
    if not validation.valid or validation.parsed is None or validation.table is None:
        return None
    ops, _ = normalize_publish(request.publish)
    images = _recent_images(session, sub, request.table, request.update_window)
    out: dict[str, Any] = {"subscription_id": sub.id, "table": validation.table,
                           "update_published": "update" in ops, "images": len(images),
                           "images_kept_per_table": UPDATE_IMAGE_WINDOW,
                           "recorded_through_filter": None}
    notes: list[str] = []
    try:
        streamed, recorded_filter = _recorded_through(conn, sub, validation.table)
    except psycopg.Error as exc:
        if conn.broken or conn.closed:
            raise SourceConnectionError(str(exc).strip()) from None
        streamed, recorded_filter = True, None
        notes.append("could not read the subscription's publications to tell which UPDATEs "
                     f"were recorded: {exc.diag.message_primary or exc}")
    out["recorded_through_filter"] = recorded_filter
    if not streamed:
        notes.append("the subscription's publications, as the source has them now, do not "
                     "send UPDATEs of this table: none are being recorded")
    elif recorded_filter is not None:
        notes.append(
            "only UPDATEs that the subscription's current filter for this table "
            f"({recorded_filter}) let through as UPDATEs are recorded; UPDATEs it dropped "
            "or turned into INSERT/DELETE are not, so for a broader candidate filter the "
            "counts may be low")
    notes.append(f"pgsieve keeps the last {UPDATE_IMAGE_WINDOW} UPDATEs per table")
    if "update" not in ops:
        return {**out, "counts": {}, "examples": {},
                "notes": ["UPDATE is not in publish: no UPDATE of this table would be sent",
                          *notes]}
    try:
        facts = read_table_facts(conn, request.table)
        json_columns = frozenset(
            c.name for c in (facts.columns if facts else ()) if c.type_name in ("json", "jsonb"))
        result = evaluate_updates(conn, request.table, validation.parsed, images,
                                  examples=request.examples, json_columns=json_columns,
                                  statement_timeout_ms=UPDATE_PREVIEW_TIMEOUT_MS)
    except psycopg.Error as exc:
        if conn.broken or conn.closed:
            raise SourceConnectionError(str(exc).strip()) from None
        if isinstance(exc, psycopg.errors.QueryCanceled):
            why = (f"evaluating the filter on the recorded UPDATEs took longer than "
                   f"{UPDATE_PREVIEW_TIMEOUT_MS} ms; use a smaller update_window")
        else:
            why = ("PostgreSQL could not evaluate the filter on the recorded UPDATEs: "
                   f"{exc.diag.message_primary or exc}")
        return {**out, "counts": {}, "examples": {}, "notes": [why, *notes]}
    if not images:
        notes.insert(0, "no UPDATE of this table has been recorded for the subscription yet")
    return {**out, **result.as_dict(), "notes": [*result.notes, *notes]}


# --------------------------------------------------------------------------------------
# effective filters


def effective_of_publications(conn: psycopg.Connection[Any], names: list[str]) -> dict[str, Any]:
    """Per table, what the publications that exist on the source replicate together."""
    pubs = read_publications(conn, names)
    tables = read_tables(conn)
    return {
        "publications": [p.name for p in pubs],
        "tables": [f.as_dict() for f in effective_filters(pubs, tables)],
    }


def effective_of_subscription(conn: psycopg.Connection[Any], sub: Subscription) -> dict[str, Any]:
    """What the subscription's publications, as the catalog has them now, replicate per
    table, and the publications it names that no longer exist."""
    names = [str(n) for n in dict.fromkeys(sub.publications or [])]
    with catalog_snapshot(conn):
        live = read_live_publications(conn, names, with_published=False)
        tables = read_tables(conn)
    pubs = [live[n].definition for n in names if n in live]
    return {
        "publications": [p.name for p in pubs],
        "missing_publications": [n for n in names if n not in live],
        "tables": [f.as_dict() for f in effective_filters(pubs, tables)],
    }
