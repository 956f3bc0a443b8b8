"""Routing: one decoded change to the subscriptions whose own filters match it.

Exactly as PostgreSQL: a filter in the subset proven exact is compiled to a fast
predicate (:mod:`.columns`, :mod:`.predicate`, :mod:`.compiler`) and indexed
(:mod:`.router`); PostgreSQL evaluates every other one, a batch per round trip
(:mod:`.pgeval`, the one module that does I/O); :mod:`.shadow` re-checks a sample of
fast decisions in PostgreSQL and stops the stream with ``routing_divergence`` on any
difference; :mod:`.grouping` says which subscriptions may share one stream at all;
:mod:`.fanout` turns the shared stream's transactions into each member's own. See
docs/routing.md.
"""

from pgsieve.routing.columns import TableColumn, TableShape, ValueFamily
from pgsieve.routing.compiler import CompiledFilter, compile_filter
from pgsieve.routing.fanout import TransactionFanout, UnroutedRelation, truncate_routes
from pgsieve.routing.grouping import (
    Conflict,
    Grouping,
    SharingCandidate,
    SharingGroup,
    StreamOptions,
    group_subscriptions,
    sharing_conflicts,
)
from pgsieve.routing.router import (
    FilterCheck,
    FilterEvaluator,
    Operation,
    Router,
    Routing,
    RowChange,
    SubscriptionFilters,
    table_31_1,
)
from pgsieve.routing.shadow import (
    ROUTING_DIVERGENCE_CODE,
    Divergence,
    RoutingDivergence,
    ShadowChecker,
)

__all__ = [
    "ROUTING_DIVERGENCE_CODE",
    "CompiledFilter",
    "Conflict",
    "Divergence",
    "FilterCheck",
    "FilterEvaluator",
    "Grouping",
    "Operation",
    "Router",
    "Routing",
    "RoutingDivergence",
    "RowChange",
    "ShadowChecker",
    "SharingCandidate",
    "SharingGroup",
    "StreamOptions",
    "SubscriptionFilters",
    "TableColumn",
    "TableShape",
    "TransactionFanout",
    "UnroutedRelation",
    "ValueFamily",
    "compile_filter",
    "group_subscriptions",
    "sharing_conflicts",
    "table_31_1",
    "truncate_routes",
]
