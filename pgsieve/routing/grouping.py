"""Which subscriptions of one source can read one shared pgoutput stream (pure).

Why: with shared decoding (issue 58), one slot's stream lists the union of several
subscriptions' publications, and :mod:`.router` hands each member what its own stream
would have carried. That is exact only when the union stream is a *superset* of every
member's own stream that the router can cut back down. PostgreSQL 15's ``pgoutput``
decides what the union carries (``get_rel_sync_entry``, ``pgoutput_row_filter_init``,
``pgoutput_column_list_init``, ``pgoutput_row_filter``); the conditions below follow from
it, each confirmed on a real cluster by ``tests/integration/test_sharing_conditions.py``
(see docs/decisions/0024-shared-decoding-groups.md). A member that may not share keeps
its own stream, with a stable reason code:

* ``decoding_own`` — the subscription asked for its own stream.
* ``option_<name>_differs`` — the pgoutput options are per stream (``parse_output_parameters``):
  ``binary`` (value encoding), ``messages``, ``origin`` (which transactions),
  ``two_phase`` (when prepared transactions arrive), ``streaming`` and
  ``proto_version`` (message framing). Members of a group have equal options.
* ``own_column_lists_conflict`` — the member's own publications give one table
  different column lists: PostgreSQL refuses its own stream already.
* ``column_lists_differ`` — the union's publications give a table different column
  lists (a FOR ALL TABLES or schema publication counts as "all columns"):
  ``pgoutput_column_list_init`` raises "cannot use different column lists for table …
  in different publications" at the table's first change.
* ``published_as_differs`` — ``publish_via_partition_root``: a leaf is published as the
  topmost ancestor any publication of the stream includes via the root, and only the
  publications at that level contribute filters and column lists. A member whose own
  stream publishes the leaf at another level would lose rows (its filter is not ORed in)
  and get another relation.
* ``filter_column_not_streamed`` — the stream carries a column list (the same for all,
  or PostgreSQL refuses) and a routed member's filter reads a column outside it: the router
  cannot evaluate that filter (``ValueUnavailable``), PostgreSQL could (it filters the
  whole tuple before projecting).
* ``update_transform_ambiguous`` — when the union filters UPDATEs (every publication
  of the stream publishing UPDATE for the table has a row filter), ``pgoutput_row_filter``
  turns an UPDATE whose old row misses and new row matches the ORed filter into an
  INSERT, and the reverse into a DELETE. The router then sees an INSERT/DELETE it cannot
  tell from a real one and applies the member's INSERT/DELETE filter, where the
  member's own stream applied its UPDATE filter. Exact only if every routed member
  publishing the table publishes INSERT, UPDATE and DELETE alike with one filter for all
  three (or publishes none of UPDATE/INSERT, resp. UPDATE/DELETE).

The last two concern only members the router must filter. A member whose filters for
a table are the stream's own (the only member publishing it, or all members alike) gets
the table's changes as they come: its own stream of the table is the shared one message
for message, and :func:`routing_filters` gives it "every row" there.

What does *not* prevent sharing: a member without a filter (the union is unfiltered for
that table and the router applies the others' filters), different publish operations
(ORed by the stream; the router skips an operation a member does not publish), FOR ALL
TABLES or FOR TABLES IN SCHEMA beside FOR TABLE (no column lists involved). The old
image an UPDATE/DELETE carries depends on the table's replica identity only, never on
the publications, so every member's stream carries the same old images.

Groups are formed greedily in name order: a member joins the first group whose union
with it has no conflict, else starts its own. The result is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from pgsieve.routing.router import SubscriptionFilters
from pgsieve.rowfilter.effective import (
    EffectiveFilter,
    Publication,
    TableInfo,
    effective_filters,
)
from pgsieve.rowfilter.parse import FilterParseError, IssueCode, parse_filter

__all__ = [
    "COLUMN_LISTS_DIFFER",
    "DECODING_OWN",
    "FILTER_COLUMN_NOT_STREAMED",
    "OWN_COLUMN_LISTS_CONFLICT",
    "PUBLISHED_AS_DIFFERS",
    "UPDATE_TRANSFORM_AMBIGUOUS",
    "Conflict",
    "Grouping",
    "Refusal",
    "SharingCandidate",
    "SharingGroup",
    "StreamOptions",
    "group_subscriptions",
    "routing_filters",
    "sharing_conflicts",
]

DECODING_OWN = "decoding_own"
OWN_COLUMN_LISTS_CONFLICT = "own_column_lists_conflict"
COLUMN_LISTS_DIFFER = "column_lists_differ"
PUBLISHED_AS_DIFFERS = "published_as_differs"
FILTER_COLUMN_NOT_STREAMED = "filter_column_not_streamed"
UPDATE_TRANSFORM_AMBIGUOUS = "update_transform_ambiguous"

Decoding = Literal["shared", "own"]


@dataclass(frozen=True)
class StreamOptions:
    """The pgoutput options a subscription's stream is opened with (one set per stream)."""

    proto_version: int = 2
    binary: bool = False
    streaming: bool = True
    two_phase: bool = False
    origin: Literal["any", "none"] = "any"
    messages: bool = False

    def differences(self, other: StreamOptions) -> list[str]:
        """The names of the options that differ, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class SharingCandidate:
    """One subscription of the source, as grouping needs it: its publications'
    definitions (pgsieve's desired state), its stream options and its ``decoding``."""

    name: str
    publications: tuple[Publication, ...]
    options: StreamOptions = StreamOptions()
    decoding: Decoding = "shared"

    @property
    def publication_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.publications)


@dataclass(frozen=True)
class Conflict:
    """Why a set of subscriptions cannot read one stream: a stable ``code``, the table
    it is about (None for stream options), the members concerned, and a message."""

    code: str
    table: str | None
    subscriptions: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class Refusal:
    """A subscription that could not join ``group`` (its members then), and why."""

    subscription: str
    group: tuple[str, ...]
    conflict: Conflict

    @property
    def code(self) -> str:
        return self.conflict.code


@dataclass(frozen=True)
class SharingGroup:
    """Subscriptions reading one stream: ``publication_names`` is the union, in member
    order, each name once. A group of one is a subscription with its own stream."""

    subscriptions: tuple[str, ...]
    publication_names: tuple[str, ...]
    options: StreamOptions


@dataclass(frozen=True)
class Grouping:
    """Every subscription in exactly one group; ``refusals`` says, per subscription that
    could not join a group, which and why (in the order tried)."""

    groups: tuple[SharingGroup, ...]
    refusals: tuple[Refusal, ...] = ()

    def group_of(self, subscription: str) -> SharingGroup:
        return next(g for g in self.groups if subscription in g.subscriptions)

    def reasons(self, subscription: str) -> tuple[str, ...]:
        return tuple(r.code for r in self.refusals if r.subscription == subscription)


def _union(publications: Iterable[Publication]) -> list[Publication]:
    seen: dict[str, Publication] = {}
    for pub in publications:
        seen.setdefault(pub.name, pub)
    return list(seen.values())


def _by_table(effective: Iterable[EffectiveFilter]) -> dict[str, EffectiveFilter]:
    return {e.table: e for e in effective}


def _has_column_conflict(effective: EffectiveFilter) -> bool:
    return any(i.code == IssueCode.CONFLICTING_COLUMN_LISTS for i in effective.issues)


def _filter_columns(text: str) -> frozenset[str] | None:
    """Columns a (normalized) filter reads; None if it cannot be parsed (fail closed)."""
    try:
        return parse_filter(text).columns
    except FilterParseError:
        return None


@dataclass(frozen=True)
class _Member:
    candidate: SharingCandidate
    effective: Mapping[str, EffectiveFilter] = field(hash=False)


def _member(candidate: SharingCandidate, tables: Sequence[TableInfo]) -> _Member:
    return _Member(candidate, _by_table(effective_filters(list(candidate.publications), tables)))


def _alone_conflicts(member: _Member) -> list[Conflict]:
    """Reasons a subscription shares with nobody, whatever the others are."""
    name = member.candidate.name
    out: list[Conflict] = []
    if member.candidate.decoding == "own":
        out.append(Conflict(DECODING_OWN, None, (name,), "the subscription's decoding is own"))
    for table, eff in member.effective.items():
        if _has_column_conflict(eff):
            out.append(Conflict(
                OWN_COLUMN_LISTS_CONFLICT, table, (name,),
                f"{name}'s own publications give {eff.published_as} different column lists: "
                "PostgreSQL refuses its own stream"))
    return out


def _union_conflicts(members: Sequence[_Member], tables: Sequence[TableInfo]) -> list[Conflict]:
    """Reasons these members cannot read one stream listing all their publications."""
    out: list[Conflict] = []
    first = members[0].candidate.options
    for m in members[1:]:
        for option in first.differences(m.candidate.options):
            out.append(Conflict(
                f"option_{option}_differs", None, (members[0].candidate.name, m.candidate.name),
                f"pgoutput option {option} is one per stream: "
                f"{getattr(first, option)!r} ≠ {getattr(m.candidate.options, option)!r}"))
    union = _by_table(effective_filters(
        _union(p for m in members for p in m.candidate.publications), tables))
    for table, shared in union.items():
        holders = [m for m in members if table in m.effective]
        if _has_column_conflict(shared) and not any(
                _has_column_conflict(m.effective[table]) for m in holders):
            out.append(Conflict(
                COLUMN_LISTS_DIFFER, table, tuple(m.candidate.name for m in holders),
                f"the publications give {shared.published_as} different column lists; "
                "PostgreSQL 15 refuses to decode the table for one stream of them "
                "(pgoutput_column_list_init)"))
            continue
        moved = [m for m in holders if m.effective[table].published_as != shared.published_as]
        if moved:
            out.append(Conflict(
                PUBLISHED_AS_DIFFERS, table, tuple(m.candidate.name for m in moved),
                f"the shared stream publishes {table} as {shared.published_as} "
                "(publish_via_partition_root), "
                + ", ".join(f"{m.candidate.name}'s own as {m.effective[table].published_as}"
                            for m in moved)))
            continue
        # a member whose filters are the stream's own for the table takes its changes as
        # they come: the router evaluates nothing for it (see routing_filters)
        routed = [m for m in holders if not _passes_through(m.effective[table], shared)]
        if shared.columns is not None:
            streamed = set(shared.columns)
            for m in routed:
                missing: set[str] = set()
                for text in m.effective[table].filters.values():
                    if text is None:
                        continue
                    read = _filter_columns(text)
                    missing |= {"<unparseable filter>"} if read is None else read - streamed
                if missing:
                    out.append(Conflict(
                        FILTER_COLUMN_NOT_STREAMED, table, (m.candidate.name,),
                        f"{m.candidate.name}'s filter on {table} reads "
                        f"{', '.join(sorted(missing))}, not in the stream's column list "
                        f"({', '.join(shared.columns)})"))
        if "update" in shared.filters and shared.filters["update"] is not None:
            for m in routed:
                ambiguous = _transform_ambiguity(m.effective[table].filters)
                if ambiguous:
                    out.append(Conflict(
                        UPDATE_TRANSFORM_AMBIGUOUS, table, (m.candidate.name,),
                        f"the shared stream filters UPDATEs of {table}, so it sends some as "
                        f"INSERT/DELETE; {m.candidate.name} {ambiguous}"))
    return out


def _passes_through(own: EffectiveFilter, shared: EffectiveFilter) -> bool:
    """The member's own stream of the table is the shared stream's, message for message:
    the same filter per published operation (and, checked before, the same relation and
    column list), so ``pgoutput`` already did all the member's filtering and
    transforming."""
    return dict(own.filters) == dict(shared.filters)


def _transform_ambiguity(filters: Mapping[str, str | None]) -> str | None:
    """Why an UPDATE turned INSERT/DELETE by the union would be routed otherwise than the
    member's own stream does (None: it would not)."""
    for other in ("insert", "delete"):
        if ("update" in filters) != (other in filters):
            return (f"publishes {'UPDATE' if 'update' in filters else other.upper()} "
                    f"but not {other.upper() if 'update' in filters else 'UPDATE'}")
        if "update" in filters and filters["update"] != filters[other]:
            return f"filters UPDATE and {other.upper()} differently"
    return None


def sharing_conflicts(candidates: Sequence[SharingCandidate],
                      tables: Iterable[TableInfo]) -> list[Conflict]:
    """Every reason ``candidates`` cannot read one stream of all their publications
    (empty: they can). One candidate alone conflicts only if it cannot stream at all."""
    known = list(tables)
    members = [_member(c, known) for c in candidates]
    out = [c for m in members for c in _alone_conflicts(m)
           if len(members) > 1 or c.code != DECODING_OWN]
    if len(members) > 1:
        out += _union_conflicts(members, known)
    return out


def routing_filters(candidates: Sequence[SharingCandidate], tables: Iterable[TableInfo]
                    ) -> dict[str, tuple[SubscriptionFilters, ...]]:
    """What the router of each relation the shared stream publishes is built with: per
    published-as relation, each member publishing it with its own filters — or with
    "every row" for each operation it publishes when its filters are the stream's own
    for the relation (its own stream is then the shared one, message for message: the
    router must not filter again, and could not always — a filter may read a column the
    column list leaves out). ``candidates`` must be able to share
    (:func:`sharing_conflicts` empty)."""
    known = list(tables)
    members = [_member(c, known) for c in candidates]
    union = _by_table(effective_filters(
        _union(p for m in members for p in m.candidate.publications), known))
    plan: dict[str, list[SubscriptionFilters]] = {}
    for table, shared in union.items():
        relation = plan.setdefault(shared.published_as, [])
        for m in members:
            own = m.effective.get(table)
            if own is None or any(f.subscription == m.candidate.name for f in relation):
                continue  # not published, or a leaf of a root already planned
            filters = (dict.fromkeys(own.filters) if _passes_through(own, shared)
                       else dict(own.filters))
            relation.append(SubscriptionFilters(m.candidate.name, filters))
    return {relation: tuple(filters) for relation, filters in plan.items()}


def group_subscriptions(candidates: Sequence[SharingCandidate],
                        tables: Iterable[TableInfo]) -> Grouping:
    """A source's subscriptions in sharing groups (see the module docstring).

    ``tables`` must be every table of the source, with ``columns`` where known: FOR ALL
    TABLES and schema publications cover only the tables given, and a column list naming
    every column counts as no list only when the columns are known (unknown, the list is
    taken as a list: a conflict PostgreSQL might not raise, never the reverse)."""
    known = list(tables)
    groups: list[list[_Member]] = []
    refusals: list[Refusal] = []
    for candidate in sorted(candidates, key=lambda c: c.name):
        member = _member(candidate, known)
        alone = _alone_conflicts(member)
        if alone:
            refusals += [Refusal(candidate.name, (), c) for c in alone]
            groups.append([member])
            continue
        for group in groups:
            if _alone_conflicts(group[0]):
                continue  # a subscription that shares with nobody
            conflicts = _union_conflicts([*group, member], known)
            if not conflicts:
                group.append(member)
                break
            refusals.append(Refusal(candidate.name, tuple(g.candidate.name for g in group),
                                    conflicts[0]))
        else:
            groups.append([member])
    return Grouping(
        tuple(SharingGroup(
            tuple(m.candidate.name for m in group),
            tuple(p.name for p in _union(p for m in group for p in m.candidate.publications)),
            group[0].candidate.options) for group in groups),
        tuple(refusals))
