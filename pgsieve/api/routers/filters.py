"""Row filters on a source: try one on real data (``filter-preview``, optionally on a
subscription's recent UPDATEs) and see what several publications combined replicate per
table (``effective-filters``, for a source and a list of publications, or for a
subscription)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from psycopg.rows import tuple_row

from pgsieve.api import rowdata
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, SettingsDep, may_see_rows
from pgsieve.api.schemas.filters import FilterPreviewRequest, FilterPreviewResponse
from pgsieve.api.schemas.publications import AnyPublicationName
from pgsieve.platform.errors import ErrorCode, PgsieveError
from pgsieve.platform.lookups import load_source, load_subscription, source_connection
from pgsieve.publications import filter_preview as service
from pgsieve.security.tokens import Principal

router = APIRouter(tags=["row filters"])


def _needs_operator(principal: Principal, why: str) -> PgsieveError:
    return PgsieveError(
        f"{why}: that needs the 'operator' role; token '{principal.name}' has "
        f"'{principal.role.name}'. A viewer may preview what a stored publication publishes: "
        "name it in `publication` and leave `where` out",
        code=ErrorCode.FORBIDDEN, status=403, title="Forbidden", required_role="operator",
        role=principal.role.name)


def _request(body: FilterPreviewRequest, stored: service.StoredFilter | None,
             rows_allowed: bool) -> service.PreviewRequest:
    """The preview to run: the body, with a stored publication's filter in place of its
    own, and without sample rows or examples for a token that may not see rows."""
    where = body.where if stored is None else stored.where
    assert where is not None
    return service.PreviewRequest(
        table=body.table,
        where=where,
        publish=body.publish if stored is None else stored.publish,
        publish_via_partition_root=(body.publish_via_partition_root if stored is None
                                    else stored.publish_via_partition_root),
        sample_size=body.sample_size if rows_allowed else 0,
        examples=body.examples if rows_allowed else 0,
        update_window=body.update_window,
        publication=body.publication,
        columns=body.columns,
        subscription_id=body.subscription_id,
    )


@router.post("/sources/{source_id}/filter-preview", operation_id="previewFilter",
             response_model=FilterPreviewResponse)
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
    try:
        stored = service.stored_filter(session, source.id, table=body.table, where=body.where,
                                       publication=body.publication,
                                       viewer=not rows_allowed)
    except service.NeedsOperator as exc:
        raise _needs_operator(principal, exc.why) from None
    request = _request(body, stored, rows_allowed)
    sub = service.preview_subscription(session, source, request.subscription_id)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        out = service.run_preview(conn, session, settings, sub, request,
                                  rows_allowed=rows_allowed)
    if not rows_allowed:
        out = rowdata.preview(out)
        out["warnings"] = [*out["warnings"], {
            "code": "sample_withheld",
            "message": f"sample rows are shown to operator and admin tokens; token "
                       f"'{principal.name}' is a {principal.role.name}"}]
    return out


@router.get("/sources/{source_id}/effective-filters", operation_id="getSourceEffectiveFilters")
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
        return service.effective_of_publications(conn, publications)


@router.get("/subscriptions/{subscription_id}/effective-filters",
            operation_id="getSubscriptionEffectiveFilters")
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
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        body = service.effective_of_subscription(conn, sub)
    return {"subscription_id": sub.id, "source_id": source.id, **body}
