"""Row data is for operators and admins: what a viewer's answers leave out.

Every response field that can carry the values of rows is withheld from a viewer token:

* filter previews: sample rows and UPDATE examples (never read for a viewer), and the
  messages of issues and notes that quote PostgreSQL (``filter_evaluation_error`` and
  kin: ``invalid input syntax for type integer: "Alice"`` is a value);
* subscriptions and progress: ``error`` and ``tables[].error`` (an apply error carries
  PostgreSQL's DETAIL, ``Key (email)=(…) already exists``), ``conflict.key`` and
  ``conflict.detail``, ``tables[].last_missing.key``, ``slot_probe_error`` (decoding
  evaluates row filters) and ``stats.last_transient_error``;
* jobs: ``error``, ``last_error``, ``tables[].error`` and the verify result's checksums.

A withheld text is replaced by :data:`WITHHELD` (a withheld key or checksum by null), so a
viewer still sees *that* something failed, where, and its stable code (``error_code``,
``conflict.kind``, a job's ``error_code``) — what an on-call dashboard needs.
"""

from __future__ import annotations

from typing import Any

WITHHELD = ("(withheld: PostgreSQL's message may quote row values; operator and admin "
            "tokens see it)")

#: Preview issues whose message can quote PostgreSQL evaluating the filter on rows.
DATA_ISSUES = frozenset({"filter_evaluation_error", "preview_incomplete",
                         "filter_rejected_by_postgres", "validation_timeout"})


def _text(value: Any) -> Any:
    return None if value is None else WITHHELD


def _tables(tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for table in tables:
        table = {**table, "error": _text(table.get("error"))}
        missing = table.get("last_missing")
        if isinstance(missing, dict):
            table["last_missing"] = {**missing, "key": None}
        out.append(table)
    return out


def subscription(body: dict[str, Any]) -> dict[str, Any]:
    """A subscription as a viewer sees it."""
    conflict = body.get("conflict")
    if isinstance(conflict, dict):
        conflict = {**conflict, "key": None, "detail": _text(conflict.get("detail"))}
    return {**body, "error": _text(body.get("error")), "conflict": conflict,
            "tables": _tables(body.get("tables") or [])}


def progress(body: dict[str, Any]) -> dict[str, Any]:
    """A subscription's progress as a viewer sees it."""
    stats = dict(body.get("stats") or {})
    if "last_transient_error" in stats:
        stats["last_transient_error"] = _text(stats["last_transient_error"])
    return {**body, "error": _text(body.get("error")),
            "slot_probe_error": _text(body.get("slot_probe_error")), "stats": stats,
            "tables": _tables(body.get("tables") or [])}


def job(body: dict[str, Any]) -> dict[str, Any]:
    """A job as a viewer sees it."""
    verify = body.get("verify")
    if isinstance(verify, dict):
        def plain(t: dict[str, Any]) -> dict[str, Any]:
            return {**t, "source_checksum": None, "target_checksum": None}
        verify = {**verify, "tables": [plain(t) for t in verify.get("tables") or []],
                  "differences": [plain(t) for t in verify.get("differences") or []]}
    return {**body, "error": _text(body.get("error")),
            "last_error": _text(body.get("last_error")), "verify": verify,
            "tables": [{**t, "error": _text(t.get("error"))} for t in body["tables"]]}


def preview(body: dict[str, Any]) -> dict[str, Any]:
    """A filter preview as a viewer sees it (no sample was read for it)."""
    def issues(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**i, "message": WITHHELD} if i.get("code") in DATA_ISSUES else i
                for i in items]
    updates = body.get("update_transformations")
    if isinstance(updates, dict):
        updates = {**updates, "examples": {}, "notes": [
            n for n in updates.get("notes") or [] if not n.startswith(_PG_NOTES)]}
    return {**body, "errors": issues(body.get("errors") or []),
            "warnings": issues(body.get("warnings") or []), "sample": [],
            "update_transformations": updates}


#: Notes of the UPDATE preview that quote PostgreSQL (see publications/filter_preview.py).
_PG_NOTES = ("PostgreSQL could not evaluate", "could not read the subscription's")
