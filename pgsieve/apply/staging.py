"""A table's net effect as rows of its staging table, in COPY text format.

A staging table mirrors its target table's writable columns (``c0`` … ``cN``, typed as
the target's, NULL allowed) and adds what the merge needs per key:

* ``_op`` — the final operation (:mod:`.net_effect` ``OP_*``);
* ``_first``, ``_lsn`` — the key's first change (``I``/``U``/``D``) and its commit LSN,
  to name the change a conflict is about;
* ``_m`` — which columns hold received values: a string of ``0``/``1``, character *j+1*
  for column *j* (a clear column keeps the target's value, or takes its default);
* ``o0`` … ``oK`` — the origin key (where a moved row lived before the batch), for rows
  whose clear columns are taken from another row of the target.

Column names are positional so no user column name can clash with ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pgsieve.apply import hotpath
from pgsieve.apply.copytext import FIELD, NULL, ROW, as_field, finish
from pgsieve.apply.net_effect import (
    EXPECT,
    FIRST,
    LSN,
    MASK,
    OP_ABSENT,
    OP_DELETE,
    OP_INSERT,
    OP_REPLACE,
    OP_UPDATE,
    ORIGIN,
    TableEffect,
)
from pgsieve.apply.net_effect import (
    ROW as ENTRY_ROW,
)

SCHEMA = "pgsieve"
"""The target's schema of pgsieve's own tables (staging, the applied record, marks)."""
META_COLUMNS = ("_op", "_first", "_lsn", "_m")


def mask_text(mask: int, width: int) -> str:
    """``_m`` for a mask: character j+1 is ``1`` when bit j is set."""
    return "".join("1" if mask >> j & 1 else "0" for j in range(width))


@dataclass
class StageSummary:
    """What the merge needs to know about a staged table, besides its rows."""

    rows: int = 0
    ops: dict[int, int] = field(default_factory=dict)
    insert_masks: set[int] = field(default_factory=set)
    """Masks of inserted rows that take clear columns from their defaults."""
    update_masks: dict[int, int] = field(default_factory=dict)
    """Rows updated in place, by mask."""
    moved: int = 0
    """Inserted rows whose clear columns come from an origin row of the target."""

    def merge(self, other: StageSummary) -> None:
        self.rows += other.rows
        for op, n in other.ops.items():
            self.ops[op] = self.ops.get(op, 0) + n
        self.insert_masks |= other.insert_masks
        for m, n in other.update_masks.items():
            self.update_masks[m] = self.update_masks.get(m, 0) + n
        self.moved += other.moved

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "ops": self.ops, "insert_masks": sorted(self.insert_masks),
                "update_masks": {str(m): n for m, n in self.update_masks.items()},
                "moved": self.moved}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageSummary:
        return cls(d["rows"], {int(k): v for k, v in d["ops"].items()},
                   set(d["insert_masks"]),
                   {int(m): n for m, n in d["update_masks"].items()}, d["moved"])


_OPS = tuple(str(i).encode() for i in range(5))


class StageEncoder:
    """Encodes the entries of :class:`TableEffect` objects of one target table."""

    def __init__(self, width: int, key_positions: Sequence[int] | None) -> None:
        self.width = width
        self.key_positions = tuple(key_positions or ())
        self.nkey = len(self.key_positions)
        self._masks: dict[int, bytes] = {}
        self._lsns: dict[int, bytes] = {}
        self._no_origin = [NULL] * self.nkey
        self._empty = [NULL] * width
        self.summary = StageSummary()

    def _mask(self, mask: int) -> bytes:
        m = self._masks.get(mask)
        if m is None:
            m = self._masks[mask] = mask_text(mask, self.width).encode()
        return m

    def _lsn(self, lsn: int) -> bytes:
        t = self._lsns.get(lsn)
        if t is None:
            t = self._lsns[lsn] = str(lsn).encode()
        return t

    def encode_copy(self, effect: TableEffect) -> bytes:
        """The COPY text payload of ``effect`` (empty when it has no rows): the compiled
        encoder when built (:mod:`.hotpath`), else :func:`.copytext.finish` of
        :meth:`encode`, the reference."""
        compiled = hotpath.active
        with hotpath.gc_paused():
            if compiled is not None:
                payload: bytes = compiled.encode_copy(self, effect)
                return payload
            return finish(self.encode(effect))

    def encode(self, effect: TableEffect) -> list[bytes]:
        """The staging lines (COPY payload pieces, see :mod:`.copytext`) of ``effect``."""
        out: list[bytes] = []
        append = out.append
        kp = self.key_positions
        single = self.nkey == 1
        summary = self.summary
        ops = summary.ops
        for key, e in effect.entries.items():
            row = e[ENTRY_ROW]
            origin = e[ORIGIN]
            if e[EXPECT]:
                if row is None:
                    op = OP_DELETE
                elif origin == key:
                    op = OP_UPDATE
                else:
                    op = OP_REPLACE
            else:
                op = OP_INSERT if row is not None else OP_ABSENT
            ops[op] = ops.get(op, 0) + 1
            if row is None:
                fields = list(self._empty)
                mask = b""
            else:
                fields = [v if type(v) is bytes else NULL for v in row]
                m = e[MASK]
                mask = self._mask(m)
                if op == OP_UPDATE:
                    um = summary.update_masks
                    um[m] = um.get(m, 0) + 1
                elif origin is None:
                    summary.insert_masks.add(m)
                else:
                    summary.moved += 1
            if single:
                fields[kp[0]] = as_field(key)
            else:
                for p, v in zip(kp, key, strict=True):  # type: ignore[call-overload]
                    fields[p] = as_field(v)
            if origin is not None and op != OP_UPDATE:
                okey = [as_field(origin)] if single else [as_field(v) for v in origin]
            else:
                okey = self._no_origin
            append(FIELD.join([_OPS[op], e[FIRST].encode(), self._lsn(e[LSN]),
                               mask or NULL, *okey, *fields]) + ROW)
        for row, m in effect.appends:
            ops[OP_INSERT] = ops.get(OP_INSERT, 0) + 1
            summary.insert_masks.add(m)
            fields = [v if type(v) is bytes else NULL for v in row]
            append(FIELD.join([_OPS[OP_INSERT], b"I", b"0", self._mask(m), *self._no_origin,
                               *fields]) + ROW)
        summary.rows += len(out)
        return out
