"""Row filters on a source: try one on real data (``filter-preview``) and see what several
publications combined replicate per table (``effective-filters``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from psycopg.rows import tuple_row

from pgsieve.api.deps import (
    SecretBoxDep,
    SessionDep,
    SettingsDep,
    load_source,
    source_connection,
)
from pgsieve.api.schemas.filters import FilterPreviewRequest, FilterPreviewResponse
from pgsieve.core.errors import Unreachable
from pgsieve.core.pubcatalog import read_publications, read_tables
from pgsieve.core.rowfilter.catalog import SourceConnectionError
from pgsieve.core.rowfilter.effective import effective_filters
from pgsieve.core.rowfilter.preview import preview_filter

router = APIRouter(prefix="/sources/{source_id}", tags=["row filters"])


@router.post("/filter-preview", response_model=FilterPreviewResponse)
def filter_preview(
    source_id: str,
    body: FilterPreviewRequest,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
) -> dict[str, Any]:
    """Validation verdict (with PostgreSQL's own dry run), replica identity, row counts
    (true / NULL), sample rows; ``estimated`` when counted from a TABLESAMPLE. Read-only."""
    source = load_source(session, source_id)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        try:
            preview = preview_filter(
                conn,
                body.table,
                body.where,
                body.publish,
                sample_size=body.sample_size,
                exact_row_limit=settings.preview_exact_row_limit,
            )
        except SourceConnectionError as exc:
            raise Unreachable(f"lost the connection to the source: {exc}") from None
    return preview.as_dict()


@router.get("/effective-filters")
def source_effective_filters(
    source_id: str,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
    publications: Annotated[list[str], Query(min_length=1, max_length=64)],
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
