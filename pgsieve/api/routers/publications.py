"""``/sources/{id}/publications``: publications with row filters, desired state vs catalog.

The desired state lives in the metadata store and is applied to the source in one
transaction (:mod:`pgsieve.publications.service`); the metadata write happens inside that
transaction, so neither side keeps a change the other refused. Responses carry the live
catalog state and the drift between the two.
"""

from __future__ import annotations

from typing import Annotated, Any

import psycopg
from fastapi import APIRouter, Path, Query, Response, status
from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.api.deps import SecretBoxDep, SessionDep, SettingsDep
from pgsieve.api.schemas.publications import (
    AnyPublicationName,
    PublicationCreate,
    PublicationImport,
    PublicationOut,
    PublicationPatch,
    PublicationPlanOut,
    PublicationTableIn,
)
from pgsieve.platform import dispatch
from pgsieve.platform.errors import Conflict, ErrorCode, NotFound
from pgsieve.platform.lookups import load_source, source_connection
from pgsieve.platform.models import Publication as PublicationRow
from pgsieve.platform.models import PublicationTable, Source, Subscription
from pgsieve.publications.catalog import (
    LivePublication,
    catalog_snapshot,
    publication_names,
    read_live_publications,
)
from pgsieve.publications.patch import PublicationEdits, TableAlter, patched_definition
from pgsieve.publications.service import (
    ApplyResult,
    PublicationCode,
    PublicationInvalid,
    PublicationIssue,
    TableSpec,
    apply_publication,
    canonical_publish,
    drift,
    drop_publication,
    normalize_definition,
    publication_lock,
    restore,
    unapplied_filters,
    validate_definition,
)
from pgsieve.rowfilter.effective import Publication, PublishedTable
from pgsieve.rowfilter.parse import (
    IssueCode,
)
from pgsieve.sync import reconcile
from pgsieve.sync.queue import active_sync_job

router = APIRouter(prefix="/sources/{source_id}/publications", tags=["publications"])

NameParam = Annotated[AnyPublicationName, Path(description="the publication's name")]

DryRun = Annotated[
    bool,
    Query(description="validate and apply in a transaction that is rolled back; "
                      "nothing changes"),
]


# --------------------------------------------------------------------------------------
# conversions


def _desired(row: PublicationRow) -> Publication:
    return Publication(
        name=row.name,
        tables=tuple(
            PublishedTable(t.table_name, t.where,
                           None if t.columns is None else tuple(t.columns))
            for t in row.tables
        ),
        schemas=tuple(row.schemas or ()),
        all_tables=row.all_tables,
        publish=frozenset(row.publish or ()),
        publish_via_partition_root=row.publish_via_partition_root,
    )


def _store(row: PublicationRow, pub: Publication) -> None:
    row.all_tables = pub.all_tables
    row.schemas = list(pub.schemas)
    row.publish = list(canonical_publish(pub.publish))
    row.publish_via_partition_root = pub.publish_via_partition_root
    row.managed = True
    # Update members in place: the unit of work inserts before it deletes, so replacing a
    # member by a new row with the same name would trip the unique constraint.
    existing = {t.table_name: t for t in row.tables}
    members: list[PublicationTable] = []
    for member in pub.tables:
        item = existing.get(member.table) or PublicationTable(table_name=member.table)
        item.where = member.where
        item.columns = None if member.columns is None else list(member.columns)
        members.append(item)
    row.tables = members


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


# --------------------------------------------------------------------------------------
# metadata helpers


def _row(session: Session, source: Source, name: str) -> PublicationRow | None:
    return session.scalar(select(PublicationRow).where(
        PublicationRow.source_id == source.id, PublicationRow.name == name))


def _users(session: Session, source: Source, name: str) -> list[str]:
    subs = session.scalars(select(Subscription).where(Subscription.source_id == source.id))
    return sorted(s.name for s in subs if name in (s.publications or []))


def _save(
    session: Session,
    conn: psycopg.Connection[Any],
    source: Source,
    pub: Publication,
    row: PublicationRow | None,
    *,
    dry_run: bool,
    point: reconcile.ChangePoint | None = None,
) -> tuple[Publication, LivePublication, list[PublicationIssue]]:
    """Validate, apply in one source transaction, write the metadata inside it, commit
    both; on any failure neither keeps the change."""
    pub, errors, warnings = validate_definition(conn, pub)
    if errors and all(e.code == IssueCode.VALIDATION_TIMEOUT for e in errors):
        raise Conflict(f"{errors[0].message} (validating {errors[0].table})",
                       code=PublicationCode.BUSY)
    if errors:
        raise PublicationInvalid(errors, warnings)

    def write_metadata(result: ApplyResult) -> None:
        if dry_run:
            return
        target = row if row is not None else PublicationRow(source_id=source.id, name=pub.name)
        _store(target, result.after.definition)
        session.add(target)
        try:
            session.flush()
        except IntegrityError:
            session.rollback()
            raise Conflict(f"a publication named '{pub.name}' already exists",
                           code=PublicationCode.EXISTS) from None
        if point is not None:
            point.after_ddl(conn)

    try:
        result = apply_publication(conn, pub, create=row is None, commit=not dry_run,
                                   on_applied=write_metadata,
                                   before_ddl=None if point is None else point.before_ddl)
        warnings = warnings + [w for w in result.warnings if w not in warnings]
        if not dry_run:
            try:
                session.commit()
            except BaseException:
                session.rollback()
                # The source committed, the metadata did not: put the catalog back.
                restore(conn, pub.name, result.before)
                raise
    except BaseException:
        session.rollback()
        raise
    return result.after.definition, result.after, warnings


def _load_managed(session: Session, source: Source, name: str,
                  conn: psycopg.Connection[Any]) -> PublicationRow:
    row = _row(session, source, name)
    if row is not None:
        return row
    with catalog_snapshot(conn):
        exists = name in read_live_publications(conn, [name], with_published=False)
    if exists:
        raise Conflict(
            f"publication '{name}' exists on the source but pgsieve does not manage it; "
            "import it first (POST …/publications/import)",
            code=PublicationCode.NOT_MANAGED)
    raise NotFound(f"no publication named '{name}'", code=PublicationCode.NOT_FOUND)


# --------------------------------------------------------------------------------------
# endpoints


@router.get("", response_model=list[PublicationOut])
def list_publications(
    source_id: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> list[dict[str, Any]]:
    """Managed publications (desired state, live state, drift) and, with
    ``managed: false``, the source's other publications (importable)."""
    source = load_source(session, source_id)
    rows = {r.name: r for r in session.scalars(
        select(PublicationRow).where(PublicationRow.source_id == source.id))}
    with source_connection(source, settings, box, row_factory=tuple_row) as conn, \
            catalog_snapshot(conn):
        live = read_live_publications(conn, sorted(set(publication_names(conn)) | set(rows)))
    names = sorted(set(rows) | set(live))
    return [_out(n, _desired(rows[n]) if n in rows else None, live.get(n)) for n in names]


@router.get("/{name}", response_model=PublicationOut)
def get_publication(
    source_id: str, name: NameParam, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    source = load_source(session, source_id)
    row = _row(session, source, name)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn, \
            catalog_snapshot(conn):
        live = read_live_publications(conn, [name]).get(name)
    if row is None and live is None:
        raise NotFound(f"no publication named '{name}'", code=PublicationCode.NOT_FOUND)
    return _out(name, _desired(row) if row is not None else None, live)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=PublicationOut)
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
    if _row(session, source, body.name) is not None:
        raise Conflict(f"a publication named '{body.name}' already exists",
                       code=PublicationCode.EXISTS)
    pub = normalize_definition(body.name, _specs(body.tables), body.schemas, body.all_tables,
                               body.publish, body.publish_via_partition_root)
    with source_connection(source, settings, box, row_factory=tuple_row) as conn, \
            publication_lock(conn, body.name):
        session.expire_all()  # read the metadata as the previous lock holder left it
        if _row(session, source, body.name) is not None:
            raise Conflict(f"a publication named '{body.name}' already exists",
                           code=PublicationCode.EXISTS)
        desired, live, warnings = _save(session, conn, source, pub, None, dry_run=dry_run)
    if dry_run:
        response.status_code = status.HTTP_200_OK
    return _out(body.name, desired, live, warnings, dry_run=dry_run)


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


def _patched(row: PublicationRow, body: PublicationPatch) -> Publication:
    """The desired definition after applying the PATCH body."""
    return patched_definition(row.name, _desired(row), _edits(body))


@router.patch("/{name}", response_model=PublicationOut)
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
    with source_connection(source, settings, box, row_factory=tuple_row) as conn, \
            publication_lock(conn, name):
        # Under the lock, from the desired state the previous change committed: two
        # PATCHes of one publication take turns instead of undoing each other.
        session.expire_all()
        row = _load_managed(session, source, name, conn)
        pub = _patched(row, body)
        reconciling = body.reconcile == "diff" and not dry_run
        before = _before_reconcile(session, source, name, conn) if reconciling else None
        point = None if before is None else reconcile.ChangePoint(
            session, source, name, before, pub, settings, box.decrypt(source.dsn_encrypted))
        desired, live, warnings = _save(session, conn, source, pub, row, dry_run=dry_run,
                                        point=point)
        reconciled = (reconcile.reconcile(session, source, name, before, conn,
                                          None if point is None else point.jobs)
                      if before is not None else None)
    for item in reconciled or []:
        if item["job_id"] is not None:
            dispatch.initial_sync(settings, item["job_id"])
    out = _out(name, desired, live, warnings, dry_run=dry_run)
    out["reconcile"] = reconciled
    return out


def _before_reconcile(session: Session, source: Source, name: str,
                      conn: psycopg.Connection[Any]) -> reconcile.Before:
    """Refuse a reconciling change while a subscription that would need a diff job
    already runs a sync (nothing is changed then: 409 ``sync_in_progress``); else the
    subscriptions' publications as the catalog has them before the change."""

    subs = reconcile.users(session, source, name)
    for sub in subs:
        running = active_sync_job(session, sub.id)
        if running is not None:
            raise Conflict(
                f"sync job {running} of subscription {sub.name} has not finished yet; "
                "change the publication once it has, or with reconcile: none",
                code=ErrorCode.SYNC_IN_PROGRESS, job_id=running)
    return reconcile.read_before(conn, subs)


@router.post("/{name}/plan", response_model=PublicationPlanOut)
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
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        row = _load_managed(session, source, name, conn)
        pub = _patched(row, body)
        desired, _, _ = _save(session, conn, source, pub, row, dry_run=True)
        return reconcile.plan(conn, session, source, name, desired, settings)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
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
    with source_connection(source, settings, box, row_factory=tuple_row) as conn, \
            publication_lock(conn, name):
        session.expire_all()
        row = _load_managed(session, source, name, conn)
        users = _users(session, source, name)
        if users:
            raise Conflict(
                f"publication '{name}' is used by subscription(s) {', '.join(users)}; "
                "remove it from them first",
                code=PublicationCode.IN_USE, subscriptions=users)
        if keep_in_source:
            session.delete(row)
            session.commit()
            return Response(status_code=status.HTTP_204_NO_CONTENT)

        def forget(_: LivePublication | None) -> None:
            session.delete(row)
            session.flush()

        try:
            before = drop_publication(conn, name, on_dropped=forget)
            try:
                session.commit()
            except BaseException:
                session.rollback()
                restore(conn, name, before)
                raise
        except BaseException:
            session.rollback()
            raise
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/import", status_code=status.HTTP_201_CREATED,
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
    managed = set(session.scalars(select(PublicationRow.name).where(
        PublicationRow.source_id == source.id)))
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        with catalog_snapshot(conn):
            existing = publication_names(conn)
            names = (list(dict.fromkeys(body.names)) if body.names is not None
                     else [n for n in existing if n not in managed])
            missing = [n for n in names if n not in existing]
            if missing:
                raise NotFound(
                    f"no publication named {', '.join(repr(m) for m in missing)} on the source",
                    code=PublicationCode.NOT_FOUND)
            already = [n for n in names if n in managed]
            if already:
                raise Conflict(f"already managed by pgsieve: {', '.join(already)}",
                               code=PublicationCode.ALREADY_MANAGED)
            live = read_live_publications(conn, names)
        notes: dict[str, list[PublicationIssue]] = {}
        for name in names:
            _, errors, warnings = validate_definition(conn, live[name].definition)
            notes[name] = errors + warnings
    try:
        for name in names:
            row = PublicationRow(source_id=source.id, name=name)
            _store(row, live[name].definition)
            session.add(row)
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict("another request imported these publications at the same time",
                       code=PublicationCode.ALREADY_MANAGED) from None
    return [_out(n, live[n].definition, live[n], notes[n]) for n in names]
