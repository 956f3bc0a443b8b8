"""Table shapes on both sides of a subscription, and when a target column can take a source
column's values.

Why a rule of our own: native logical replication converts every value through the
target column's text input function, so it fails at apply time (and stops) when a source
value does not parse. pgsieve refuses such a subscription when it is created instead: a
target column is compatible when every text a source column can produce is accepted by
the target column's type — the same type, or a widening that cannot fail (``int4`` into
``int8``, ``varchar(10)`` into ``text``, anything into ``text``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pgsieve.rowfilter.parse import quote_ident, quote_qualified


@dataclass(frozen=True, slots=True)
class TargetColumn:
    """A column of a target table, as its catalog describes it."""

    name: str
    type_name: str
    """``format_type(atttypid, atttypmod)``, e.g. ``character varying(20)``."""
    stage_type: str
    """The type staging tables use for it: a domain's base type (NULL must be allowed)."""
    collation: str | None = None
    """A non-default collation (quoted identifier), kept on staging columns for equality."""
    generated: bool = False
    """A stored generated column: computed by the target, never written."""
    not_null: bool = False
    has_default: bool = False
    has_equality: bool = True
    """The type has a default btree/hash equality (REPLICA IDENTITY FULL matching)."""
    type_oid: int = 0
    """The column's type (a domain's base type) as an OID, 0 when not read: compared
    with a Relation message's to see a source type change (:mod:`.schemachange`)."""
    type_mod: int = -1
    """Its ``atttypmod`` (a domain's ``typtypmod``)."""


@dataclass(frozen=True, slots=True)
class TargetTable:
    """A target table: its writable columns and how to address it."""

    schema: str
    name: str
    oid: int
    relkind: str
    """``r`` (table) or ``p`` (partitioned table)."""
    columns: tuple[TargetColumn, ...]
    """Writable (non-generated) columns, in attribute order."""
    generated: tuple[str, ...] = ()
    unique: tuple[frozenset[str], ...] = ()
    """Column sets of the table's unique indexes (plain, valid, not partial)."""
    identity: tuple[str, ...] = ()
    """The columns PostgreSQL's apply worker finds a row by: the target's replica
    identity index, else its primary key (``GetRelationIdentityOrPK``); empty when it has
    neither. A source table with REPLICA IDENTITY FULL is matched on these, not on every
    old value, when they are all published."""
    index: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    accepted_types: set[tuple[str, int, int]] = field(
        default_factory=set, compare=False, hash=False, repr=False)
    """(column, source type OID, typmod) a Relation sends that differ from this shape's
    type but that the column takes as it is (every value fits, ``compatible``): checked
    once per shape (:mod:`.schemachange`), not for every batch."""
    renamed: tuple[tuple[str, str], ...] = field(default=(), compare=False, hash=False)
    """(old, new) names of columns the batch planned against this shape renames at the
    target before its rows (:mod:`.renames`): rows decoded before the source's RENAME
    carry the old name and land in the new one (:func:`.plan.target_names`)."""
    sql_names: list[str] = field(default_factory=list, init=False, compare=False, hash=False,
                                 repr=False)
    """Filled by :meth:`quoted` on first use."""

    def __post_init__(self) -> None:
        self.index.update({c.name: i for i, c in enumerate(self.columns)})

    def quoted(self) -> list[str]:
        """The qualified name, then each column's name, as SQL identifiers — quoted once
        per table shape: a small batch's script names them all, for every batch."""
        if not self.sql_names:
            self.sql_names[:] = [quote_qualified(self.schema, self.name),
                                 *(quote_ident(c.name) for c in self.columns)]
        return self.sql_names

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def width(self) -> int:
        return len(self.columns)

    def unique_on(self, columns: set[str] | frozenset[str]) -> bool:
        """Whether a unique index makes these columns a key (it covers a subset of them)."""
        return any(u <= columns for u in self.unique)


@dataclass(frozen=True, slots=True)
class SourceTable:
    """What ``POST /subscriptions`` checks a target table against: a published source
    table (named as the stream names it), where its rows go, and its published columns
    with their ``format_type`` names."""

    source_table: str
    target_table: str
    columns: tuple[tuple[str, str], ...]
    not_null: frozenset[str] = frozenset()


# -- type compatibility --------------------------------------------------------------------

_INTEGERS = ("smallint", "integer", "bigint")
_WIDER: dict[str, frozenset[str]] = {
    "smallint": frozenset({"integer", "bigint", "numeric", "real", "double precision"}),
    "integer": frozenset({"bigint", "numeric", "double precision"}),
    "bigint": frozenset({"numeric"}),
    "real": frozenset({"double precision"}),
    "date": frozenset({"timestamp without time zone"}),
    "json": frozenset({"jsonb"}),
    "jsonb": frozenset({"json"}),
}
_TEXT_SINKS = frozenset({"text"})
_LENGTH = re.compile(r"^(character varying|character|bit varying|bit|numeric)\((\d+)(?:,(\d+))?\)$")


def split_type(type_name: str) -> tuple[str, tuple[int, ...]]:
    m = _LENGTH.match(type_name)
    if m is None:
        return type_name, ()
    args = tuple(int(g) for g in m.groups()[1:] if g is not None)
    return m.group(1), args


def compatible(source_type: str, target_type: str) -> bool:
    """Whether every value of ``source_type`` (its text form) is accepted by
    ``target_type`` unchanged in meaning. Conservative: unknown pairs are incompatible."""
    if source_type == target_type:
        return True
    src, src_args = split_type(source_type)
    tgt, tgt_args = split_type(target_type)
    if src.endswith("[]") or tgt.endswith("[]"):
        return (src.endswith("[]") and tgt.endswith("[]")
                and compatible(source_type[:-2], target_type[:-2]))
    if tgt in _TEXT_SINKS or (tgt == "character varying" and not tgt_args):
        return True  # their input function takes any text
    if src == tgt:
        if not tgt_args:
            return True  # varchar(n) into varchar, numeric(p,s) into numeric
        if not src_args:
            return False  # unbounded into bounded
        if src in ("character varying", "bit varying"):
            return tgt_args[0] >= src_args[0]
        if src == "numeric":
            sp, ss = src_args[0], src_args[1] if len(src_args) > 1 else 0
            tp, ts = tgt_args[0], tgt_args[1] if len(tgt_args) > 1 else 0
            return ts >= ss and tp - ts >= sp - ss
        return tgt_args == src_args  # char(n), bit(n): exact length
    if tgt == "numeric" and not tgt_args and src in _INTEGERS:
        return True
    return tgt in _WIDER.get(src, frozenset())


def describe_mismatch(
    source: SourceTable, target: TargetTable, target_types: dict[str, str]
) -> list[str]:
    """Human-readable problems of ``target`` for ``source`` (empty: compatible).

    ``target_types`` maps every target column (generated ones too) to its type name."""
    problems: list[str] = []
    for name, type_name in source.columns:
        if name not in target_types:
            problems.append(f"column {name} ({type_name}) is missing")
        elif name in target.generated:
            problems.append(f"column {name} is a generated column in the target")
        elif not compatible(type_name, target_types[name]):
            problems.append(
                f"column {name} is {target_types[name]} in the target but {type_name} in "
                "the source"
            )
    published = {name for name, _ in source.columns}
    for col in target.columns:
        if col.name not in published and col.not_null and not col.has_default:
            problems.append(
                f"column {col.name} is NOT NULL without a default in the target but not "
                "published by the source (inserts would fail)"
            )
    return problems
