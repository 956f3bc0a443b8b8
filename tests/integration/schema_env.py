"""What the schema-change tests share: a batch applied through the apply harness
(:class:`tests.integration.test_apply.Pair`) under a subscription's schema-change options."""

from __future__ import annotations

import time
from dataclasses import replace

from pgsieve.apply.batch import ApplyResult, SchemaChange
from pgsieve.apply.engine import apply_batch
from tests.integration.test_apply import Pair


def apply_following(pair: Pair, per_batch: int | None, policy: str = "follow",
                    drop_columns: bool = False) -> list[ApplyResult]:
    """Read everything new and apply it under ``schema_changes: policy`` (and
    ``drop_columns``), ``per_batch`` transactions a batch (None: one batch)."""
    results = []
    for batch in pair.batches(pair.read(), per_batch):
        batch = replace(batch, schema_changes=policy,  # type: ignore[arg-type]
                        drop_columns=drop_columns)
        results.append(apply_batch(None, batch, pair.writer, distributed=False))
    pair.applied += results
    return results


def followed(results: list[ApplyResult]) -> list[SchemaChange]:
    """The schema changes the batches followed, in order."""
    return [c for r in results for c in r.schema_changes]


def native_stopped(pair: Pair, timeout: float = 60) -> None:
    """The native subscription's apply worker failed (as it does on a missing column)."""
    assert pair.native is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = pair.native.query(
            "SELECT apply_error_count FROM pg_stat_subscription_stats "
            "WHERE subname = %s", (pair.native_name,))
        if row and int(str(row[0][0])) > 0:
            return
        time.sleep(0.1)
    raise AssertionError("the native subscription did not stop on the new column")


def fix_native(pair: Pair, changes: list[SchemaChange]) -> None:
    """What a person does at the native target: the plan's DDL; native then resumes."""
    assert pair.native is not None
    native_stopped(pair)
    for c in changes:
        for statement in c.ddl:
            pair.native.execute(statement)
