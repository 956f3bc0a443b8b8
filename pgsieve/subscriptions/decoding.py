"""Shared decoding in the store: which subscriptions of a source read one slot (issue 58).

The grouping itself is pure (:mod:`pgsieve.routing.grouping`, the conditions in
docs/decisions/0024-shared-decoding-groups.md). This module feeds it from pgsieve's
desired state and keeps its result in the store:

* :func:`sharing_candidate` — a subscription as grouping sees it: its publications'
  definitions (the managed rows; a publication pgsieve does not manage is read from the
  source catalog by the caller and handed in as ``live``), its stream options and its
  ``decoding`` option (absent: ``own``, ADR 0024's default until the benchmark).
* :func:`regroup_source` — group the source's shared subscriptions and persist the
  groups of two or more as :class:`~pgsieve.platform.models.DecodingGroup` rows. A row
  is kept (and with it its slot name) for the new group its attached members overlap
  most; rows no group takes are deleted and their slot names returned, to be dropped at
  the source *after* the commit. It does not commit.
* :func:`refresh_source` — what the control plane calls after a subscription is
  created, deleted or patched, and after a publication PATCH: read the source's tables,
  regroup, commit, drop the slots of the groups that went.
* :func:`group_of` — a subscription's group and its attached members' candidates (the
  shared stream reader's input).
* :class:`SharedDecodingCollector` — ``pgsieve_shared_group_members``,
  ``pgsieve_shared_group_confirmed_lsn`` and ``pgsieve_routing_divergences_total``,
  read from the store at scrape time.

A detached member (``decoding_detached``) reads a copy of the group's slot on its own:
it is not a candidate while detached, keeps ``decoding_group_id`` (the group lists it
in ``detached``) until its group goes or its ``decoding`` becomes ``own``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform import pgserver
from pgsieve.platform.credentials import SecretBox, scrub_secrets
from pgsieve.platform.db import lock_rows
from pgsieve.platform.errors import PgsieveError
from pgsieve.platform.lookups import load_source, source_connection
from pgsieve.platform.models import DecodingGroup, Source, Subscription, new_id, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.publications import store
from pgsieve.publications.catalog import read_live_publications, read_tables
from pgsieve.routing.grouping import (
    Grouping,
    SharingCandidate,
    StreamOptions,
    group_subscriptions,
)
from pgsieve.routing.shadow import divergence_metric
from pgsieve.rowfilter.effective import Publication, TableInfo
from pgsieve.streaming.transports.base import max_proto_version

log = logging.getLogger(__name__)

DECODING_DEFAULT: Literal["own"] = "own"
"""``decoding`` when a subscription does not say (ADR 0024: own until the benchmark)."""

SHARED_SLOT_PREFIX = "pgsieve_shared_"


def decoding_of(sub: Subscription) -> Literal["shared", "own"]:
    """The subscription's ``decoding`` option (absent: :data:`DECODING_DEFAULT`)."""
    return "shared" if (sub.options or {}).get("decoding") == "shared" else DECODING_DEFAULT


def stream_options(sub: Subscription, source: Source) -> StreamOptions:
    """The pgoutput options the subscription's stream is opened with (as
    :mod:`pgsieve.streaming.pipeline` opens it: ``messages`` always on, for the filter
    change markers; the newest protocol the source speaks, at most 4)."""
    options = sub.options or {}
    return StreamOptions(
        proto_version=min(max_proto_version(source.server_version_num), 4),
        binary=bool(options.get("binary", False)),
        streaming=bool(options.get("streaming", True)),
        two_phase=False,
        messages=True,
    )


def sharing_candidate(session: Session, subscription: Subscription,
                      live: Mapping[str, Publication] | None = None) -> SharingCandidate:
    """The subscription as grouping needs it. Its publications' definitions come from
    the managed rows, else from ``live`` (the source catalog's, for publications pgsieve
    does not manage). A publication found in neither cannot be judged: the candidate is
    then ``own`` (it shares with nobody)."""
    source = session.get(Source, subscription.source_id)
    assert source is not None  # (RESTRICT: a source with subscriptions is not deleted)
    rows = store.managed_rows(session, source)
    publications: list[Publication] = []
    decoding = decoding_of(subscription)
    for name in subscription.publications or []:
        row = rows.get(name)
        if row is not None:
            publications.append(store.desired(row))
        elif live is not None and name in live:
            publications.append(live[name])
        else:
            decoding = "own"
    return SharingCandidate(subscription.name, tuple(publications),
                            stream_options(subscription, source), decoding)


def shared_slot_name(source_id: str, group_id: int) -> str:
    """``pgsieve_shared_<source id>_<group id>`` (at most 63 characters)."""
    return f"{SHARED_SLOT_PREFIX}{source_id}_{group_id}"[:63]


@dataclass(frozen=True)
class Regrouped:
    """A regrouping's result: the grouping, and the slots of the groups that went (to
    drop at the source after the commit)."""

    grouping: Grouping
    dropped_slots: tuple[str, ...]


def _subscriptions(session: Session, source_id: str) -> list[Subscription]:
    return list(session.scalars(select(Subscription).where(
        Subscription.source_id == source_id).order_by(Subscription.name)))


def regroup_source(session: Session, source_id: str, tables: Sequence[TableInfo],
                   live: Mapping[str, Publication] | None = None,
                   wal_lsn: int | None = None) -> Regrouped:
    """Group the source's shared subscriptions and persist the groups (no commit). The
    source's row is held until the caller's commit: two regroupings of one source take
    turns, the second from what the first wrote. ``wal_lsn``: the source's WAL position
    now, recorded as ``decoding_since_lsn`` of each subscription put in a new group."""
    lock_rows(session, Source, [source_id])
    session.expire_all()
    subs = _subscriptions(session, source_id)
    group_before = {s.name: s.decoding_group_id for s in subs}
    shared = [s for s in subs if decoding_of(s) == "shared" and not s.decoding_detached]
    by_name = {s.name: s for s in subs}
    grouping = group_subscriptions([sharing_candidate(session, s, live) for s in shared],
                                   tables)
    formed = [g for g in grouping.groups if len(g.subscriptions) >= 2]
    rows = list(session.scalars(select(DecodingGroup).where(
        DecodingGroup.source_id == source_id).order_by(DecodingGroup.id)))
    attached = {r.id: {s.name for s in subs
                       if s.decoding_group_id == r.id and not s.decoding_detached}
                for r in rows}
    # keep the row whose attached members overlap a new group most (ties: the oldest
    # row, the first group)
    pairs = sorted(((len(attached[r.id] & set(g.subscriptions)), r.id, gi, r)
                    for gi, g in enumerate(formed) for r in rows),
                   key=lambda p: (-p[0], p[1], p[2]))
    kept: dict[int, DecodingGroup] = {}
    taken: set[int] = set()
    for overlap, _, gi, old in pairs:
        if overlap and gi not in kept and old.id not in taken:
            kept[gi] = old
            taken.add(old.id)
    gone = [r for r in rows if r.id not in taken]
    for sub in subs:  # members are set again below
        if not sub.decoding_detached or decoding_of(sub) == "own" or any(
                sub.decoding_group_id == r.id for r in gone):
            sub.decoding_group_id = None
            sub.decoding_detached = False
    for gi, group in enumerate(formed):
        row = kept.get(gi)
        if row is None:
            row = DecodingGroup(source_id=source_id,
                                slot_name=f"{SHARED_SLOT_PREFIX}new_{new_id()}")
            session.add(row)
            session.flush()
            row.slot_name = shared_slot_name(source_id, row.id)
        if list(row.publication_names or []) != list(group.publication_names):
            row.publication_names = list(group.publication_names)
        row.updated_at = utcnow()
        for name in group.subscriptions:
            by_name[name].decoding_group_id = row.id
    refused: dict[str, dict[str, Any]] = {}
    for refusal in grouping.refusals:
        if refusal.code != "decoding_own":
            refused.setdefault(refusal.subscription, {
                "code": refusal.code, "message": refusal.conflict.message,
                "group": list(refusal.group)})
    for sub in subs:
        alone = decoding_of(sub) == "shared" and sub.decoding_group_id is None
        reason = refused.get(sub.name) if alone else None
        if sub.decoding_refusal != reason:
            sub.decoding_refusal = reason
    for sub in subs:
        if sub.decoding_group_id is not None and sub.decoding_group_id != group_before[sub.name]:
            sub.decoding_since_lsn = wal_lsn
    session.flush()
    for row in gone:
        session.delete(row)
    session.flush()
    return Regrouped(grouping, tuple(r.slot_name for r in gone))


def _needs_regrouping(session: Session, source_id: str) -> bool:
    if session.scalar(select(DecodingGroup.id).where(DecodingGroup.source_id == source_id)
                      .limit(1)) is not None:
        return True
    return any(decoding_of(s) == "shared" or s.decoding_refusal is not None
               for s in _subscriptions(session, source_id))


def refresh_source(session: Session, settings: Settings, box: SecretBox,
                   source_id: str) -> Regrouped | None:
    """Regroup the source from its catalog's tables, commit, then drop the slots of the
    groups that went (best effort: a slot left behind is logged). None when the source
    has nothing shared (no connection is opened) or cannot be read now: the groups stay
    as they were and the next change regroups (a deleted member's ``decoding_group_id``
    went with it)."""
    if not _needs_regrouping(session, source_id):
        return None
    source = load_source(session, source_id)
    try:
        with source_connection(source, settings, box, row_factory=tuple_row) as conn:
            wal_lsn = pgserver.current_wal_lsn(conn)
            tables = read_tables(conn)
            unmanaged = sorted({
                p for s in _subscriptions(session, source_id) for p in s.publications or []
            } - set(store.managed_rows(session, source)))
            live = {name: pub.definition for name, pub in
                    read_live_publications(conn, unmanaged, with_published=False).items()
                    } if unmanaged else {}
    except PgsieveError as exc:
        log.warning("source %s: cannot read its tables to regroup its shared decoding: %s",
                    source.name, exc.detail)
        return None
    slots = {r.id: r.slot_name for r in session.scalars(select(DecodingGroup).where(
        DecodingGroup.source_id == source_id))}
    joined = {s.id: (s.decoding_group_id, s.slot_name)
              for s in _subscriptions(session, source_id) if s.decoding_joined}
    regrouped = regroup_source(session, source_id, tables, live, wal_lsn)
    leaving = [(sub, slots[old], own) for sid, (old, own) in joined.items()
               if old in slots and (sub := session.get(Subscription, sid)) is not None
               and sub.decoding_group_id != old]
    if leaving:
        _give_own_slots(source, settings, box, [(slot, own) for _, slot, own in leaving])
        for sub, _, _ in leaving:
            sub.decoding_joined = False
    session.commit()
    drop_group_slots(settings, box, source, regrouped.dropped_slots)
    return regrouped


def _give_own_slots(source: Source, settings: Settings, box: SecretBox,
                    copies: Sequence[tuple[str, str]]) -> None:
    """Members leaving the group they read get their own slot back before the change
    commits (their streams open on it next): a copy of the group's, which is confirmed
    no further than any member's target holds (ADR 0024: read with the member's own
    publications, exactly its own stream)."""
    with source_connection(source, settings, box) as conn:
        for group_slot, own in copies:
            if not pgserver.get_slot(conn, own) and pgserver.get_slot(conn, group_slot):
                conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)",
                             (group_slot, own))


def drop_group_slots(settings: Settings, box: SecretBox, source: Source,
                     slots: Sequence[str]) -> None:
    """Drop the slots of groups that went, where they exist (the shared stream reader
    creates a group's slot; a group that never streamed has none)."""
    if not slots:
        return
    try:
        with source_connection(source, settings, box) as conn:
            for slot in slots:
                if pgserver.get_slot(conn, slot):
                    pgserver.drop_slot(conn, slot)
    except Exception as exc:  # the group is gone from the store: the slot is only WAL
        log.warning("source %s: slots of shared decoding groups left behind (%s): %s",
                    source.name, ", ".join(slots), scrub_secrets(str(exc)))


def group_of(session: Session, subscription_id: str,
             live: Mapping[str, Publication] | None = None
             ) -> tuple[DecodingGroup, list[SharingCandidate]] | None:
    """The subscription's group and its attached members' candidates in name order (the
    shared stream reader's input); None when it reads its own slot."""
    sub = session.get(Subscription, subscription_id)
    if sub is None or sub.decoding_group_id is None:
        return None
    group = session.get(DecodingGroup, sub.decoding_group_id)
    if group is None:
        return None
    members = session.scalars(select(Subscription).where(
        Subscription.decoding_group_id == group.id,
        Subscription.decoding_detached.is_(False)).order_by(Subscription.name))
    return group, [sharing_candidate(session, m, live) for m in members]


def reading_members(session: Session, group_id: int) -> list[str]:
    """The members that read the group's slot (joined: their own slot dropped), in name
    order; an attached member not among them still streams from its own slot until its
    stream catches up with the group's (:mod:`pgsieve.streaming.sharedmember`)."""
    return list(session.scalars(select(Subscription.name).where(
        Subscription.decoding_group_id == group_id, Subscription.decoding_joined.is_(True))
        .order_by(Subscription.name)))


def members_of(session: Session, group_id: int) -> tuple[list[str], list[str]]:
    """The group's attached and detached members' names, each in name order."""
    rows = session.execute(select(Subscription.name, Subscription.decoding_detached).where(
        Subscription.decoding_group_id == group_id).order_by(Subscription.name)).all()
    return [n for n, d in rows if not d], [n for n, d in rows if d]


class SharedDecodingCollector(Collector):
    """Shared decoding's figures, read from the store at scrape time."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def collect(self) -> Iterator[Metric]:
        members = GaugeMetricFamily(
            "pgsieve_shared_group_members", "subscriptions reading a shared decoding "
            "group's slot (attached members)", labels=["source", "slot"])
        confirmed = GaugeMetricFamily(
            "pgsieve_shared_group_confirmed_lsn", "a shared decoding group's confirmed "
            "LSN (its slowest attached member's applied position), as a number",
            labels=["source", "slot"])
        counts: dict[str, int] = {}
        with self._sessions() as session:
            for group, source in session.execute(
                    select(DecodingGroup, Source.name)
                    .join(Source, Source.id == DecodingGroup.source_id)
                    .order_by(DecodingGroup.id)).all():
                attached, _ = members_of(session, group.id)
                members.add_metric([source, group.slot_name], float(len(attached)))
                if group.confirmed_lsn is not None:
                    confirmed.add_metric([source, group.slot_name], float(group.confirmed_lsn))
                counts[group.slot_name] = int(group.divergences or 0)
        yield members
        yield confirmed
        yield divergence_metric(counts)
