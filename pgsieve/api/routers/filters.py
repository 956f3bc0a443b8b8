"""Row filters on a source: try one on real data (``filter-preview``, optionally on a
subscription's recent UPDATEs) and see what several publications combined replicate per
table (``effective-filters``, for a source and a list of publications, or for a
subscription)."""

from __future__ import annotations

from typing import Annotated, Any

import psycopg
from fastapi import APIRouter, Query
from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.api import rowdata
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, SettingsDep, may_see_rows
from pgsieve.api.schemas.filters import (
    IMAGES_KEPT_PER_TABLE,
    FilterPreviewRequest,
    FilterPreviewResponse,
)
from pgsieve.api.schemas.publications import AnyPublicationName
from pgsieve.platform.errors import ErrorCode, PgsieveError, Unprocessable, Unreachable
from pgsieve.platform.lookups import load_source, load_subscription, source_connection
from pgsieve.platform.models import Publication, Subscription, UpdateImage
from pgsieve.publications.catalog import (
    catalog_snapshot,
    read_live_publications,
    read_publications,
    read_tables,
)
from pgsieve.rowfilter.catalog import SourceConnectionError, read_table_facts
from pgsieve.rowfilter.effective import effective_filters
from pgsieve.rowfilter.parse import (
    FilterParseError,
    TableNameError,
    parse_filter,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.preview import (
    SAMPLE_COUNT_TIMEOUT_MS,
    FilterPreview,
    preview_filter,
)
from pgsieve.rowfilter.rules import normalize_publish
from pgsieve.rowfilter.updates import RowImages, evaluate_updates
from pgsieve.security.tokens import Principal

router = APIRouter(tags=["row filters"])

UPDATE_PREVIEW_TIMEOUT_MS = 5000


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
    body: FilterPreviewRequest,
    preview: FilterPreview,
) -> dict[str, Any] | None:
    validation = preview.validation
    if not validation.valid or validation.parsed is None or validation.table is None:
        return None
    ops, _ = normalize_publish(body.publish)
    images = _recent_images(session, sub, body.table, body.update_window)
    out: dict[str, Any] = {"subscription_id": sub.id, "table": validation.table,
                           "update_published": "update" in ops, "images": len(images),
                           "images_kept_per_table": IMAGES_KEPT_PER_TABLE,
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
    notes.append(f"pgsieve keeps the last {IMAGES_KEPT_PER_TABLE} UPDATEs per table")
    if "update" not in ops:
        return {**out, "counts": {}, "examples": {},
                "notes": ["UPDATE is not in publish: no UPDATE of this table would be sent",
                          *notes]}
    try:
        facts = read_table_facts(conn, body.table)
        json_columns = frozenset(
            c.name for c in (facts.columns if facts else ()) if c.type_name in ("json", "jsonb"))
        result = evaluate_updates(conn, body.table, validation.parsed, images,
                                  examples=body.examples, json_columns=json_columns,
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


def _sample_columns(conn: psycopg.Connection[Any], body: FilterPreviewRequest) -> list[str] | None:
    """The columns the sample may show: the named publication's column list for the table
    (as the source catalog has it), narrowed to ``body.columns``; None: every column."""
    if body.publication is None and body.columns is None:
        return None
    try:
        schema, name = parse_table_name(body.table)
    except TableNameError:
        return None  # the verdict refuses the table name; no sample is taken
    facts = read_table_facts(conn, body.table)
    if facts is None:
        return None  # the verdict says the table does not exist
    existing = [c.name for c in facts.columns]
    published: list[str] | None = None
    if body.publication is not None:
        exists = conn.execute("SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = %s",
                              (body.publication,)).fetchone()
        if exists is None:
            raise Unprocessable(f"the source has no publication '{body.publication}'",
                                code=ErrorCode.PUBLICATION_NOT_FOUND, field="publication")
        row = conn.execute(
            "SELECT attnames FROM pg_catalog.pg_publication_tables "
            "WHERE pubname = %s AND schemaname = %s AND tablename = %s",
            (body.publication, schema, name)).fetchone()
        if row is None:
            raise Unprocessable(
                f"publication '{body.publication}' does not publish {body.table}",
                code=ErrorCode.TABLE_NOT_IN_PUBLICATION, field="publication")
        published = [str(c) for c in row[0]]
    if body.columns is None:
        return published
    unknown = [c for c in body.columns if c not in existing]
    if unknown:
        raise Unprocessable(f"{body.table} has no column {', '.join(unknown)}",
                            code=ErrorCode.UNKNOWN_COLUMN, field="columns", columns=unknown)
    if published is not None:
        hidden = [c for c in body.columns if c not in published]
        if hidden:
            raise Unprocessable(
                f"publication '{body.publication}' does not publish column(s) "
                f"{', '.join(hidden)}", code=ErrorCode.COLUMN_NOT_PUBLISHED, field="columns",
                columns=hidden)
    return list(dict.fromkeys(body.columns))


def _needs_operator(principal: Principal, why: str) -> PgsieveError:
    return PgsieveError(
        f"{why}: that needs the 'operator' role; token '{principal.name}' has "
        f"'{principal.role.name}'. A viewer may preview what a stored publication publishes: "
        "name it in `publication` and leave `where` out",
        code=ErrorCode.FORBIDDEN, status=403, title="Forbidden", required_role="operator",
        role=principal.role.name)


def _with_stored_filter(session: Session, source_id: str, body: FilterPreviewRequest,
                        principal: Principal) -> FilterPreviewRequest:
    """The request to run: as given (operator and up, with ``where``), or with the filter,
    ``publish`` and ``publish_via_partition_root`` of the publication pgsieve stores for
    the source under ``publication`` — the only preview a viewer may run: what is
    published already, not a filter of its choosing (which could read any column of any
    table, a comparison at a time)."""
    viewer = not may_see_rows(principal)
    if body.where is not None and not viewer:
        return body
    if body.publication is None:
        if viewer:
            raise _needs_operator(principal, "previewing a new filter")
        raise Unprocessable("give `where`, or name a stored publication in `publication`",
                            code=ErrorCode.VALIDATION_ERROR, field="where")
    pub = session.scalar(select(Publication).where(Publication.source_id == source_id,
                                                   Publication.name == body.publication))
    if pub is None:
        raise Unprocessable(f"pgsieve stores no publication '{body.publication}' for this "
                            "source", code=ErrorCode.PUBLICATION_NOT_FOUND, field="publication")
    try:
        wanted = quote_qualified(*parse_table_name(body.table))
    except TableNameError as exc:
        raise Unprocessable(str(exc), code=ErrorCode.INVALID_TABLE_NAME, field="table") from None
    entry = next((t for t in pub.tables if _canonical(t.table_name) == wanted), None)
    if entry is None and not (pub.all_tables or parse_table_name(body.table)[0] in pub.schemas):
        raise Unprocessable(f"publication '{pub.name}' does not publish {body.table}",
                            code=ErrorCode.TABLE_NOT_IN_PUBLICATION, field="table")
    stored = entry.where if entry is not None else None
    if viewer and body.where is not None and not _same_filter(body.where, stored):
        raise _needs_operator(principal, "previewing a filter the publication does not have")
    return body.model_copy(update={
        "where": stored or "true", "publish": list(pub.publish),
        "publish_via_partition_root": pub.publish_via_partition_root})


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


def _only(columns: list[str] | None, image: Any) -> Any:
    if columns is None or not isinstance(image, dict):
        return image
    return {k: v for k, v in image.items() if k in columns}


@router.post("/sources/{source_id}/filter-preview", response_model=FilterPreviewResponse)
def filter_preview(
    source_id: str,
    body: FilterPreviewRequest,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
    principal: PrincipalDep,
) -> dict[str, Any]:
    """Validation verdict (with PostgreSQL's own dry run), replica identity, row counts
    (true / NULL), sample rows; ``estimated`` when counted from a TABLESAMPLE. A filter
    PostgreSQL cannot evaluate on some existing row is ``valid: false`` with
    ``filter_evaluation_error``; a step out of time leaves a ``preview_incomplete``
    warning. With ``subscription_id``: ``update_transformations``, Table 31.1 over the
    subscription's recent UPDATEs of the table, evaluated by PostgreSQL. Read-only.

    A filter of the caller's choosing (``where``) needs an operator or admin token. A
    viewer may preview only a stored publication's own filter for a table it publishes
    (``publication``, no ``where``), and gets its counts alone: no sample rows, no UPDATE
    examples (a ``sample_withheld`` warning says so), no PostgreSQL message that could
    quote a value, and no dry run on the source. With ``publication`` (or ``columns``)
    the rows carry only the published (or named) columns; without either, every column,
    as a publication without a column list would send them."""
    rows_allowed = may_see_rows(principal)
    source = load_source(session, source_id)
    body = _with_stored_filter(session, source.id, body, principal)
    if not rows_allowed:
        body = body.model_copy(update={"sample_size": 0, "examples": 0})
    assert body.where is not None
    sub: Subscription | None = None
    if body.subscription_id is not None:
        sub = load_subscription(session, body.subscription_id)
        if sub.source_id != source.id:
            raise Unprocessable(
                f"subscription '{sub.name}' reads another source", field="subscription_id",
                code=ErrorCode.SUBSCRIPTION_SOURCE_MISMATCH)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        try:
            columns = _sample_columns(conn, body) if rows_allowed else None
            preview = preview_filter(
                conn,
                body.table,
                body.where,
                body.publish,
                publish_via_partition_root=body.publish_via_partition_root,
                sample_size=body.sample_size,
                exact_row_limit=settings.preview_exact_row_limit,
                # no step of a preview may outlast the control-plane statement timeout,
                # whatever the filter costs per row (repeat(note, 100000000) …)
                count_timeout_ms=min(1500, settings.statement_timeout_ms),
                sample_timeout_ms=min(SAMPLE_COUNT_TIMEOUT_MS, settings.statement_timeout_ms),
                columns=columns,
                dry_run=rows_allowed,
            )
            updates = (_update_transformations(conn, session, sub, body, preview)
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
    out = {**preview.as_dict(), "update_transformations": updates,
           "sample_columns": columns}
    if not rows_allowed:
        out = rowdata.preview(out)
        out["warnings"] = [*out["warnings"], {
            "code": "sample_withheld",
            "message": f"sample rows are shown to operator and admin tokens; token "
                       f"'{principal.name}' is a {principal.role.name}"}]
    return out


def _effective(conn: psycopg.Connection[Any], names: list[str]) -> dict[str, Any]:
    with catalog_snapshot(conn):
        live = read_live_publications(conn, names, with_published=False)
        tables = read_tables(conn)
    pubs = [live[n].definition for n in names if n in live]
    return {
        "publications": [p.name for p in pubs],
        "missing_publications": [n for n in names if n not in live],
        "tables": [f.as_dict() for f in effective_filters(pubs, tables)],
    }


@router.get("/sources/{source_id}/effective-filters")
def source_effective_filters(
    source_id: str,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
    publications: Annotated[list[AnyPublicationName], Query(min_length=1, max_length=64)],
) -> dict[str, Any]:
    """Per table: the ORed filter (per operation), column list, contributing publications
    and ``redundant_because``, for publications that exist on the source — usable before
    any subscription does."""
    source = load_source(session, source_id)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        pubs = read_publications(conn, publications)
        tables = read_tables(conn)
    return {
        "publications": [p.name for p in pubs],
        "tables": [f.as_dict() for f in effective_filters(pubs, tables)],
    }


@router.get("/subscriptions/{subscription_id}/effective-filters")
def subscription_effective_filters(
    subscription_id: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    """What the subscription's publications, as the source catalog has them now,
    replicate per table: ``{tables: [{table, filter, filters (per operation), columns,
    publications, redundant_because, published_as, initial_sync_filter, issues}]}``.
    Publications the subscription names that no longer exist are listed in
    ``missing_publications`` (PostgreSQL's walsender would fail on them)."""
    sub = load_subscription(session, subscription_id)
    source = load_source(session, sub.source_id)
    names = [str(n) for n in dict.fromkeys(sub.publications or [])]
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        body = _effective(conn, names)
    return {"subscription_id": sub.id, "source_id": source.id, **body}
