"""``/sources/{id}/publications``: publications with row filters, desired state vs catalog.

The desired state lives in the metadata store and is applied to the source in one
transaction (:mod:`pgsieve.publications.store`, on :mod:`pgsieve.publications.service`);
the metadata write happens inside that transaction, so neither side keeps a change the
other refused. A change that reconciles the subscriptions using the publication is
:mod:`pgsieve.subscriptions.publication_change`. This router parses requests and renders
responses: the live catalog state and the drift between the two.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response, status
from psycopg.rows import tuple_row

from pgsieve.api.deps import SecretBoxDep, SessionDep, SettingsDep
from pgsieve.api.pagination import PageDep
from pgsieve.api.schemas.publications import (
    AnyPublicationName,
    PublicationCreate,
    PublicationImport,
    PublicationOut,
    PublicationPatch,
    PublicationPlanOut,
    PublicationTableIn,
)
from pgsieve.platform.lookups import load_source, source_connection
from pgsieve.publications import store
from pgsieve.publications.catalog import LivePublication
from pgsieve.publications.definition import (
    PublicationIssue,
    TableSpec,
    canonical_publish,
    normalize_definition,
)
from pgsieve.publications.drift import drift
from pgsieve.publications.patch import PublicationEdits, TableAlter
from pgsieve.publications.validate import unapplied_filters
from pgsieve.rowfilter.effective import Publication
from pgsieve.subscriptions import newtables, publication_change

router = APIRouter(prefix="/sources/{source_id}/publications", tags=["publications"])

NameParam = Annotated[AnyPublicationName, Path(description="the publication's name")]

DryRun = Annotated[
    bool,
    Query(description="validate and apply in a transaction that is rolled back; "
                      "nothing changes"),
]


# --------------------------------------------------------------------------------------
# conversions


def _definition_out(pub: Publication) -> dict[str, Any]:
    return {
        "tables": [{"table": t.table, "where": t.where,
                    "columns": None if t.columns is None else list(t.columns)}
                   for t in pub.tables],
        "schemas": list(pub.schemas),
        "all_tables": pub.all_tables,
        "publish": list(canonical_publish(pub.publish)),
        "publish_via_partition_root": pub.publish_via_partition_root,
    }


def _live_out(live: LivePublication | None) -> dict[str, Any] | None:
    if live is None:
        return None
    return {
        "oid": live.oid,
        "owner": live.owner,
        **_definition_out(live.definition),
        "published_tables": [
            {"table": r.table, "rowfilter": r.rowfilter, "attnames": list(r.attnames)}
            for r in live.published
        ],
    }


def _out(
    name: str,
    desired: Publication | None,
    live: LivePublication | None,
    warnings: list[PublicationIssue] | None = None,
    *,
    dry_run: bool = False,
) -> dict[str, Any]:
    managed = desired is not None
    shown = desired if desired is not None else live.definition if live else None
    assert shown is not None
    differences = drift(desired, live) if desired is not None else []
    notes = list(warnings or [])
    noted = {(w.code, w.table) for w in notes}
    # filters the definition lists that PostgreSQL does not apply, on every read
    notes += [w for w in unapplied_filters(shown) if (w.code, w.table) not in noted]
    return {
        "name": name,
        "managed": managed,
        **_definition_out(shown),
        "live": _live_out(live),
        "drift": [d.as_dict() for d in differences],
        "in_sync": not differences,
        "warnings": [w.as_dict() for w in notes],
        "dry_run": dry_run,
    }


def _specs(tables: list[PublicationTableIn]) -> list[TableSpec]:
    return [TableSpec(t.table, t.where, None if t.columns is None else tuple(t.columns))
            for t in tables]


def _edits(body: PublicationPatch) -> PublicationEdits:
    """The request's edits in the publications domain's terms (see ``patch.py``)."""
    return PublicationEdits(
        tables=None if body.tables is None else _specs(body.tables),
        add=_specs(body.add_tables),
        alter=[TableAlter(a.table, a.where, None if a.columns is None else tuple(a.columns),
                          frozenset(a.model_fields_set)) for a in body.alter_tables],
        drop=list(body.drop_tables),
        schemas=body.schemas,
        all_tables=body.all_tables,
        publish=body.publish,
        publish_via_partition_root=body.publish_via_partition_root,
    )


# --------------------------------------------------------------------------------------
# endpoints


@router.get("", operation_id="listPublications", response_model=list[PublicationOut])
def list_publications(
    source_id: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep,
    page: PageDep,
) -> list[dict[str, Any]]:
    """Managed publications (desired state, live state, drift) and, with
    ``managed: false``, the source's other publications (importable). By name, ``limit``
    per page (``Link: rel="next"`` while more remain)."""
    source = load_source(session, source_id)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        found = store.read_all(session, source, conn)
    shown = page.of_list(found, lambda f: (f[0],), 1)
    return [_out(name, desired, live) for name, desired, live in shown]


@router.get("/{name}", operation_id="getPublication", response_model=PublicationOut)
def get_publication(
    source_id: str, name: NameParam, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    source = load_source(session, source_id)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        desired, live = store.read_one(session, source, name, conn)
    return _out(name, desired, live)


@router.post("", operation_id="createPublication",
             status_code=status.HTTP_201_CREATED, response_model=PublicationOut)
def create_publication(
    source_id: str,
    body: PublicationCreate,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
    dry_run: DryRun = False,
) -> dict[str, Any]:
    """Create a publication (FOR TABLE with per-table ``where``/``columns``, FOR TABLES IN
    SCHEMA, or FOR ALL TABLES) after validating every member."""
    source = load_source(session, source_id)
    store.ensure_new(session, source, body.name)
    pub = normalize_definition(body.name, _specs(body.tables), body.schemas, body.all_tables,
                               body.publish, body.publish_via_partition_root)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        saved = store.create(session, conn, source, pub, dry_run=dry_run)
    if dry_run:
        response.status_code = status.HTTP_200_OK
    else:  # a subscription may name it already (re-created after a drop by hand)
        newtables.follow_publication(session, settings, source.id, body.name)
    return _out(body.name, saved.definition, saved.live, saved.warnings, dry_run=dry_run)


@router.patch("/{name}", operation_id="updatePublication", response_model=PublicationOut)
def patch_publication(
    source_id: str,
    name: NameParam,
    body: PublicationPatch,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
    dry_run: DryRun = False,
) -> dict[str, Any]:
    """Change tables (replace the list, or add/alter/drop members), filters, column lists,
    schemas, publish operations, publish_via_partition_root. A publication missing from the
    source (dropped by hand) is re-created."""
    source = load_source(session, source_id)
    saved, reconciled = publication_change.change_publication(
        session, settings, box, source, name, _edits(body),
        reconciling=body.reconcile == "diff" and not dry_run, dry_run=dry_run)
    out = _out(name, saved.definition, saved.live, saved.warnings, dry_run=dry_run)
    out["reconcile"] = reconciled
    return out


@router.post("/{name}/plan", operation_id="planPublicationChange",
             response_model=PublicationPlanOut)
def plan_publication_change(
    source_id: str,
    name: NameParam,
    body: PublicationPatch,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
) -> dict[str, Any]:
    """What the PATCH with this body would do to every subscription using the
    publication, per table: effective filter and column list before and after, and the
    rows to add, remove and keep, counted on the source (exact below the preview's
    threshold, else sampled: ``estimated``). The change is validated and applied in a
    source transaction that is rolled back, so the "after" is the definition exactly as
    PostgreSQL would store it; nothing changes."""
    source = load_source(session, source_id)
    return publication_change.plan_change(session, settings, box, source, name, _edits(body))


@router.delete("/{name}", operation_id="deletePublication", status_code=status.HTTP_204_NO_CONTENT)
def delete_publication(
    source_id: str,
    name: NameParam,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
    keep_in_source: Annotated[
        bool, Query(description="stop managing it but leave it on the source")
    ] = False,
) -> Response:
    """Drop the publication on the source and forget its desired state (one transaction);
    refused with 409 ``publication_in_use`` while a subscription names it."""
    source = load_source(session, source_id)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        store.drop(session, conn, source, name, keep_in_source=keep_in_source)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/import", operation_id="importPublications", status_code=status.HTTP_201_CREATED,
             response_model=list[PublicationOut])
def import_publications(
    source_id: str,
    body: PublicationImport,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
) -> list[dict[str, Any]]:
    """Adopt publications pgsieve did not create: their catalog definition becomes the
    desired state (nothing changes on the source). Rules pgsieve would have refused are
    listed as ``warnings``."""
    source = load_source(session, source_id)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        imported = store.import_publications(session, conn, source, body.names)
    store.adopt(session, source, imported)
    return [_out(i.name, i.live.definition, i.live, i.notes) for i in imported]
