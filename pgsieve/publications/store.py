"""A managed publication's desired state in the metadata store, kept in step with the
source catalog: read it, save a change, drop or import a publication — apart from HTTP.

Why this shape: the metadata row is written *inside* the source transaction that applies
the DDL (:func:`~.service.apply_publication`'s ``on_applied``), so a failing metadata
write rolls the catalog back; and if the metadata commit fails after the source
committed, :func:`~.service.restore` puts the previous catalog definition back. Neither
side keeps a change the other refused. What a change means for the subscriptions using
the publication (a reconciliation) is handed in as a :class:`ChangeHook` by the layer
that knows them (:mod:`pgsieve.subscriptions.publication_change`). The router
(:mod:`pgsieve.api.routers.publications`) parses the request and renders the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.platform.errors import Conflict, NotFound
from pgsieve.platform.models import Publication as PublicationRow
from pgsieve.platform.models import PublicationTable, Source, Subscription
from pgsieve.publications.catalog import (
    LivePublication,
    catalog_snapshot,
    publication_names,
    read_live_publications,
)
from pgsieve.publications.definition import (
    PublicationCode,
    PublicationInvalid,
    PublicationIssue,
    canonical_publish,
)
from pgsieve.publications.service import (
    ApplyResult,
    apply_publication,
    drop_publication,
    publication_lock,
    restore,
)
from pgsieve.publications.validate import validate_definition
from pgsieve.rowfilter.effective import Publication, PublishedTable
from pgsieve.rowfilter.parse import IssueCode


class ChangeHook(Protocol):
    """Work that runs inside the change's source transaction: before the DDL, and after
    it once the metadata row is flushed (a reconciliation's change point)."""

    def before_ddl(self, conn: psycopg.Connection[Any]) -> None: ...

    def after_ddl(self, conn: psycopg.Connection[Any]) -> None: ...


@dataclass(frozen=True)
class Saved:
    """A saved (or dry-run) change: the definition as PostgreSQL stored it, the live
    publication, and the warnings of validation and apply."""

    definition: Publication
    live: LivePublication
    warnings: list[PublicationIssue]


# --------------------------------------------------------------------------------------
# the metadata row


def desired(row: PublicationRow) -> Publication:
    """The desired state a metadata row keeps."""
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


def store(row: PublicationRow, pub: Publication) -> None:
    """Write ``pub`` into the metadata row (its members updated in place)."""
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


def find(session: Session, source: Source, name: str) -> PublicationRow | None:
    """The metadata row of a managed publication, if pgsieve manages one by that name."""
    return session.scalar(select(PublicationRow).where(
        PublicationRow.source_id == source.id, PublicationRow.name == name))


def managed_rows(session: Session, source: Source) -> dict[str, PublicationRow]:
    """The source's managed publications by name."""
    return {r.name: r for r in session.scalars(
        select(PublicationRow).where(PublicationRow.source_id == source.id))}


def users(session: Session, source: Source, name: str) -> list[str]:
    """Names of the subscriptions that name the publication, sorted."""
    subs = session.scalars(select(Subscription).where(Subscription.source_id == source.id))
    return sorted(s.name for s in subs if name in (s.publications or []))


def load_managed(session: Session, source: Source, name: str,
                 conn: psycopg.Connection[Any]) -> PublicationRow:
    """The managed publication's row; 409 ``not_managed`` when the source has one by that
    name that pgsieve does not manage, else 404."""
    row = find(session, source, name)
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


def _exists(name: str) -> Conflict:
    return Conflict(f"a publication named '{name}' already exists", code=PublicationCode.EXISTS)


# --------------------------------------------------------------------------------------
# reads


def read_all(
    session: Session, source: Source, conn: psycopg.Connection[Any]
) -> list[tuple[str, Publication | None, LivePublication | None]]:
    """Every publication by name: managed ones (desired, live) and the source's others
    (``None``, live)."""
    rows = managed_rows(session, source)
    with catalog_snapshot(conn):
        live = read_live_publications(conn, sorted(set(publication_names(conn)) | set(rows)))
    names = sorted(set(rows) | set(live))
    return [(n, desired(rows[n]) if n in rows else None, live.get(n)) for n in names]


def read_one(
    session: Session, source: Source, name: str, conn: psycopg.Connection[Any]
) -> tuple[Publication | None, LivePublication | None]:
    """One publication's desired state (None: not managed) and live state; 404 when
    neither exists."""
    row = find(session, source, name)
    with catalog_snapshot(conn):
        live = read_live_publications(conn, [name]).get(name)
    if row is None and live is None:
        raise NotFound(f"no publication named '{name}'", code=PublicationCode.NOT_FOUND)
    return (desired(row) if row is not None else None), live


# --------------------------------------------------------------------------------------
# changes


def save(
    session: Session,
    conn: psycopg.Connection[Any],
    source: Source,
    pub: Publication,
    row: PublicationRow | None,
    *,
    dry_run: bool,
    point: ChangeHook | None = None,
) -> Saved:
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
        store(target, result.after.definition)
        session.add(target)
        try:
            session.flush()
        except IntegrityError:
            session.rollback()
            raise _exists(pub.name) from None
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
    return Saved(result.after.definition, result.after, warnings)


def ensure_new(session: Session, source: Source, name: str) -> None:
    """409 ``exists`` when pgsieve already manages a publication by that name."""
    if find(session, source, name) is not None:
        raise _exists(name)


def create(session: Session, conn: psycopg.Connection[Any], source: Source,
           pub: Publication, *, dry_run: bool) -> Saved:
    """Create a managed publication under its advisory lock."""
    with publication_lock(conn, pub.name):
        session.expire_all()  # read the metadata as the previous lock holder left it
        ensure_new(session, source, pub.name)
        return save(session, conn, source, pub, None, dry_run=dry_run)


def drop(session: Session, conn: psycopg.Connection[Any], source: Source, name: str,
         *, keep_in_source: bool) -> None:
    """Drop the publication on the source and forget its desired state (one transaction),
    or with ``keep_in_source`` only forget it; 409 ``publication_in_use`` while a
    subscription names it."""
    with publication_lock(conn, name):
        session.expire_all()
        row = load_managed(session, source, name, conn)
        using = users(session, source, name)
        if using:
            raise Conflict(
                f"publication '{name}' is used by subscription(s) {', '.join(using)}; "
                "remove it from them first",
                code=PublicationCode.IN_USE, subscriptions=using)
        if keep_in_source:
            session.delete(row)
            session.commit()
            return

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


@dataclass(frozen=True)
class Imported:
    """An adopted publication: its catalog definition and what validation noted."""

    name: str
    live: LivePublication
    notes: list[PublicationIssue]


def import_publications(session: Session, conn: psycopg.Connection[Any], source: Source,
                        names: list[str] | None) -> list[Imported]:
    """Adopt publications pgsieve did not create (``None``: every unmanaged one): their
    catalog definition becomes the desired state, nothing changes on the source."""
    managed = set(session.scalars(select(PublicationRow.name).where(
        PublicationRow.source_id == source.id)))
    with catalog_snapshot(conn):
        existing = publication_names(conn)
        wanted = (list(dict.fromkeys(names)) if names is not None
                  else [n for n in existing if n not in managed])
        missing = [n for n in wanted if n not in existing]
        if missing:
            raise NotFound(
                f"no publication named {', '.join(repr(m) for m in missing)} on the source",
                code=PublicationCode.NOT_FOUND)
        already = [n for n in wanted if n in managed]
        if already:
            raise Conflict(f"already managed by pgsieve: {', '.join(already)}",
                           code=PublicationCode.ALREADY_MANAGED)
        live = read_live_publications(conn, wanted)
    notes: dict[str, list[PublicationIssue]] = {}
    for name in wanted:
        _, errors, warnings = validate_definition(conn, live[name].definition)
        notes[name] = errors + warnings
    return [Imported(n, live[n], notes[n]) for n in wanted]


def adopt(session: Session, source: Source, imported: list[Imported]) -> None:
    """Write the imported publications' metadata rows (after the source connection is
    closed); 409 ``already_managed`` if another request adopted them meanwhile."""
    try:
        for item in imported:
            row = PublicationRow(source_id=source.id, name=item.name)
            store(row, item.live.definition)
            session.add(row)
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict("another request imported these publications at the same time",
                       code=PublicationCode.ALREADY_MANAGED) from None
