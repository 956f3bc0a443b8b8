"""The apply job's plan and staging as Spark tasks, for big batches.

The driver walks the batch once, lightly: it routes each change, counts it, and reads
only its key to pick a partition (a hash of the key; a table with an UPDATE that changes
a key goes to one partition whole, because a moved row links two keys). Each partition's
share — raw pgoutput bytes, in commit order — becomes one row of a DataFrame with one row
per partition; ``mapInArrow`` runs :func:`stage_partition` on each: the same pure net
effect as the driver path (:mod:`pgsieve.apply.planbuilder`), then a COPY of its rows into
the shared staging tables over its own target connection. Keys never span partitions, so
the staged rows are exactly what the driver path would stage. The merge is the driver's,
as for small batches.

Source DDL (``schema_changes``) is decided before any task runs, in the driver, by the
same loop as the driver path's (:func:`~pgsieve.apply.following.plan_following`): the
batch's Relation messages are all the driver walk needs, and each followed change is
split again against the target's shape after it. The tasks get those shapes (and stage
against them, as the driver path stages before its merge); the merge runs the DDL first
in its transaction and records it in the journal, as for a driver batch.

The apply engine (:mod:`pgsieve.apply.engine`) does not import this module: it asks a
:class:`~pgsieve.apply.planner.DistributedPlanner`, and :class:`SparkPlanner` is the one
:mod:`pgsieve.workers` hands in. The threshold between the two paths is the engine's.
"""

from __future__ import annotations

import json
import pickle
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa  # type: ignore[import-untyped]

from pgsieve.apply.batch import ApplyBatch, TableRoute
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.driver import fetch_pending
from pgsieve.apply.fetchmarks import key_of_text, key_text
from pgsieve.apply.following import plan_following
from pgsieve.apply.merge import StagedTable
from pgsieve.apply.plan import BatchPlan, RelationMap, RelationMaps, TablePlan
from pgsieve.apply.planbuilder import PlanBuilder, RawView, TargetResolver, raw_view
from pgsieve.apply.planner import DistributedPlanner
from pgsieve.apply.staging import StageEncoder, StageSummary
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.connpolicy import ConnectionScope, connection_scope, policy_in_force
from pgsieve.platform.faults import fault_point
from pgsieve.platform.settings import Settings
from pgsieve.spark.session import (
    cluster_task_slots,
    executors_ready,
    get_spark,
    job_group_report,
    spark_unavailable,
)
from pgsieve.spark.shipping import checked
from pgsieve.wire.assembler import Change
from pgsieve.wire.decoder import Decoder
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import Delete, Insert, Relation, Truncate, Update
from pgsieve.wire.msgtypes import (
    DELETE,
    INSERT,
    TRUNCATE,
    TUPLE_KEY,
    UPDATE,
)

_U32 = struct.Struct("!I").unpack_from


@dataclass
class _TableItems:
    """One target table's changes in one partition, in commit order."""

    ti: list[int] = field(default_factory=list)
    ci: list[int] = field(default_factory=list)
    lsn: list[int] = field(default_factory=list)
    commit: list[int] = field(default_factory=list)
    rel: list[int] = field(default_factory=list)
    payload: list[Any] = field(default_factory=list)
    """Raw pgoutput bytes, or a decoded message (streamed/spilled transactions)."""

    def append(self, ti: int, ci: int, lsn: int, commit: int, rel: int, payload: Any) -> None:
        self.ti.append(ti)
        self.ci.append(ci)
        self.lsn.append(lsn)
        self.commit.append(commit)
        self.rel.append(rel)
        self.payload.append(payload)

    def _columns(self) -> list[list[Any]]:
        return [self.ti, self.ci, self.lsn, self.commit, self.rel, self.payload]

    def extend_sorted(self, other: _TableItems) -> None:
        rows = sorted(zip(*[a + b for a, b in zip(self._columns(), other._columns(),
                                                   strict=True)], strict=True),
                      key=lambda r: (r[0], r[1]))
        columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[]] * 6
        self.ti, self.ci, self.lsn, self.commit, self.rel, self.payload = (
            list(c) for c in columns)

    def clear(self) -> None:
        self.ti, self.ci, self.lsn, self.commit, self.rel, self.payload = [], [], [], [], [], []


class _Splitter(PlanBuilder):
    """The driver's light walk: routes, counts, images, truncates — and, instead of net
    effects, each change appended to its partition."""

    def __init__(self, batch: ApplyBatch, resolve: Any, applied_lsn: Lsn | None,
                 partitions: int, known: RelationMaps | None = None) -> None:
        super().__init__(batch, resolve, applied_lsn, known)
        self.partitions = partitions
        self.parts: list[dict[str, _TableItems]] = [{} for _ in range(partitions)]
        self.whole: dict[str, int] = {}
        """Tables sent to one partition whole (key changes, no key)."""
        self.relations: list[Relation] = []
        self.rel_index: dict[int, int] = {}

    def _rel_idx(self, rel: Relation) -> int:
        idx = self.rel_index.get(id(rel))
        if idx is None:
            idx = self.rel_index[id(rel)] = len(self.relations)
            self.relations.append(rel)
        return idx

    def _make_whole(self, name: str) -> int:
        part = self.whole.get(name)
        if part is not None:
            return part
        part = self.whole[name] = hash(name) % self.partitions
        into = self.parts[part].setdefault(name, _TableItems())
        for p, tables in enumerate(self.parts):
            if p != part and name in tables:
                into.extend_sorted(tables.pop(name))
        return part

    def _ship(self, rm: RelationMap, key: Any, ti: int, ci: int, lsn: int, commit: Lsn,
              rel: Relation, payload: Any) -> None:
        name = rm.target.qualified_name
        part = self.whole.get(name)
        if part is None:
            part = hash(key) % self.partitions
        items = self.parts[part].get(name)
        if items is None:
            items = self.parts[part][name] = _TableItems()
        items.append(ti, ci, lsn, commit.value, self._rel_idx(rel), payload)

    def truncate(self, msg: Truncate, rels: Any, pos: tuple[int, int],
                 commit_lsn: Lsn) -> None:
        super().truncate(msg, rels, pos, commit_lsn)
        for rel in rels:
            rm = self.relation_map(rel)
            if rm is not None and rm.route.applies(commit_lsn):
                for tables in self.parts:  # everything before the TRUNCATE is moot
                    items = tables.get(rm.target.qualified_name)
                    if items is not None:
                        items.clear()

    def raw_segments(self, raw: RawView,
                     segments: Sequence[tuple[int, Lsn, int, int]]) -> None:
        for ti, commit_lsn, start, stop in segments:
            self.raw_changes(raw._replace(start=start, stop=stop), ti, commit_lsn)

    def raw_changes(self, raw: RawView, ti: int, commit_lsn: Lsn) -> None:
        raws, buf, offsets, first, stop, rel_list, rel_map, lsns, proto = raw
        for i in range(first, stop):
            ci = i - first
            data = raws[i] if raws is not None else buf[offsets[i]:offsets[i + 1]]
            kind = data[0]
            if kind not in (INSERT, UPDATE, DELETE):
                if kind == TRUNCATE:
                    msg = Decoder(proto, lazy=True).decode(data)
                    rels = rel_list[ci] if rel_list is not None else tuple(
                        cast(Mapping[int, Relation], rel_map)[r]
                        for r in cast(Truncate, msg).relation_ids)
                    self.change(Change(Lsn(lsns[i]), cast(Truncate, msg), rels), ti, ci,
                                commit_lsn)
                continue
            if rel_list is not None:
                rel = rel_list[ci][0]
            else:
                rel = cast(Mapping[int, Relation], rel_map)[_U32(data, 1)[0]]
            routed = self._route(rel, ti, ci, commit_lsn)
            if routed is None:
                continue
            rm, _tp = routed
            counts = self.counts_for(rm.source_table)
            name = rm.target.qualified_name
            key: Any = None
            if kind == INSERT:
                counts.inserts += 1
                key = _raw_key(data, 6, rm)
            elif kind == UPDATE:
                counts.updates += 1
                self._image(rm, (lsns[i], data))
                if data[5] == TUPLE_KEY or rm.mode != "key":
                    self._make_whole(name)
                else:
                    key = _raw_key(data, 6, rm)
            else:
                counts.deletes += 1
                key = _raw_key(data, 6, rm)
            if key is None:
                self._make_whole(name)
            self._ship(rm, key, ti, ci, lsns[i], commit_lsn, rel, data)

    def change(self, ch: Change, ti: int, ci: int, commit_lsn: Lsn) -> None:
        msg = ch.message
        if isinstance(msg, Truncate):
            self.truncate(msg, ch.relations, (ti, ci), commit_lsn)
            return
        if not isinstance(msg, Insert | Update | Delete):
            return
        routed = self._route(ch.relations[0], ti, ci, commit_lsn)
        if routed is None:
            return
        rm, _tp = routed
        counts = self.counts_for(rm.source_table)
        name = rm.target.qualified_name
        key: Any = None
        if isinstance(msg, Insert):
            counts.inserts += 1
            if rm.mode == "key":
                key = _safe_key(rm, msg.new.values)
        elif isinstance(msg, Update):
            counts.updates += 1
            self._image(rm, ch)
            if msg.old is None and rm.mode == "key":
                key = _safe_key(rm, msg.new.values)
        else:
            counts.deletes += 1
            if rm.mode == "key":
                key = _safe_key(rm, msg.old.values)
        if key is None:
            self._make_whole(name)
        self._ship(rm, key, ti, ci, ch.lsn.value, commit_lsn, ch.relations[0], msg)


def _safe_key(rm: RelationMap, values: Any) -> Any:
    key = rm.key_of(values)
    parts = key if isinstance(key, tuple) else (key,)
    return None if any(type(v) is not bytes for v in parts) else key


def _raw_key(data: bytes, pos: int, rm: RelationMap) -> Any:
    """The key of the tuple at ``pos`` (text or binary bytes), or None when it cannot be
    read cheaply (unchanged TOAST, NULL, no key): the table then goes to one partition."""
    if rm.mode != "key":
        return None
    need = rm.key_rel
    last = max(need)
    try:
        pos += 2
        values: list[bytes] = []
        for _ in range(last + 1):
            kind = data[pos]
            if kind == 0x74 or kind == 0x62:
                n = int.from_bytes(data[pos + 1:pos + 5], "big")
                values.append(data[pos + 5:pos + 5 + n])
                pos += 5 + n
            elif kind == 0x6E:
                values.append(b"")
                pos += 1
            else:
                return None
    except IndexError:
        return None
    if len(need) == 1:
        return values[need[0]]
    return tuple(values[i] for i in need)


# -- the Spark task ------------------------------------------------------------------------


def stage_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow: plan and stage one partition's share; yields a JSON summary per table."""

    for rb in batches:
        for payload in rb.column("payload").to_pylist():
            job = pickle.loads(payload)  # noqa: S301 - written by our own driver
            started = time.perf_counter()
            routes: dict[str, TableRoute] = job["routes"]
            targets: dict[str, TargetTable] = job["targets"]
            relations: list[Relation] = job["relations"]
            batch = ApplyBatch(job["subscription_id"], [], routes)
            builder = PlanBuilder(batch, targets.__getitem__, None)
            proto = job["proto"]
            for name, items in job["tables"].items():
                del name
                _feed(builder, items, relations, proto)
            plan = builder.build()
            # every connection of the task (target, and the source for unchanged TOAST
            # values) is checked and pinned with the driver's policy
            with connection_scope(ConnectionScope(job["policy"])):
                writer = TargetWriter(job["target_dsn"], job["subscription_id"],
                                      source_dsn=job["source_dsn"])
                out: dict[str, Any] = {}
                try:
                    fetched = fetch_pending(writer, plan)
                    for name, tp in plan.tables.items():
                        out[name] = _stage_table(writer, tp, job["staging"].get(name))
                        out[name]["fetched"] = [[key_text(k), m, lsn]
                                                for k, (m, lsn) in tp.fetched.items()]
                    writer.conn.commit()
                finally:
                    writer.close()
            # The crash tests kill the whole worker here, in the middle of the Spark job.
            fault_point("spark.task_staged", group=True)
            yield pa.RecordBatch.from_pydict({"result": [json.dumps({
                "tables": out, "fetched": fetched,
                "seconds": time.perf_counter() - started})]})


def _feed(builder: PlanBuilder, items: _TableItems, relations: list[Relation], proto: int) -> None:
    """Replay one table's items through the builder, transaction by transaction."""
    rels = [(r,) for r in relations]
    n = len(items.ti)
    i = 0
    while i < n:
        ti = items.ti[i]
        commit_lsn = Lsn(items.commit[i])
        raws: list[bytes] = []
        rel_list: list[tuple[Relation, ...]] = []
        lsns: list[int] = []
        while i < n and items.ti[i] == ti:
            payload = items.payload[i]
            if isinstance(payload, bytes):
                raws.append(payload)
                rel_list.append(rels[items.rel[i]])
                lsns.append(items.lsn[i])
            else:
                if raws:
                    builder.raw_changes(RawView.of_lists(raws, rel_list, lsns, proto), ti,
                                        commit_lsn)
                    raws, rel_list, lsns = [], [], []
                builder.change(Change(Lsn(items.lsn[i]), payload, rels[items.rel[i]]), ti,
                               items.ci[i], commit_lsn)
            i += 1
        if raws:
            builder.raw_changes(RawView.of_lists(raws, rel_list, lsns, proto), ti, commit_lsn)


def _stage_table(writer: TargetWriter, tp: TablePlan, staging: str | None) -> dict[str, Any]:
    reason = tp.reason()
    if reason is not None or staging is None:
        return {"sequential": reason or "not staged", "summary": StageSummary().to_dict()}
    kp = tp.key_positions if tp.mode == "key" else ()
    encoder = StageEncoder(tp.target.width, kp)
    payload = encoder.encode_copy(tp.effect)
    if payload:
        writer.copy_in(staging, writer.staging_columns(tp.target, kp or ()), payload)
    return {"sequential": None, "summary": encoder.summary.to_dict()}


# -- the driver -------------------------------------------------------------------------------


def apply_job_group(batch: ApplyBatch) -> str:
    """The Spark job group of one batch's tasks: which subscription, up to which LSN — so
    Spark's UI and status API name the pgsieve batch they ran for."""
    return f"pgsieve-apply-{batch.subscription_id}-{batch.end_lsn}"


def plan_and_stage(spark: Any, batch: ApplyBatch, writer: TargetWriter, expected: Lsn | None,
                   timings: dict[str, float]
                   ) -> tuple[BatchPlan, dict[str, StagedTable], int, dict[str, Any]]:
    """Split the batch, have Spark tasks plan and stage each part, and return the plan,
    the staged tables, the rows fetched for unchanged TOAST values, and what Spark ran
    for it (:func:`~pgsieve.spark.session.job_group_report` of :func:`apply_job_group`;
    empty when nothing was shipped)."""

    t = time.perf_counter()
    partitions = max(2, int(spark.sparkContext.defaultParallelism))
    splits: list[_Splitter] = []

    def split(resolve: TargetResolver) -> BatchPlan:
        splits.append(_Splitter(batch, resolve, expected, partitions, writer.relation_maps))
        return splits[-1].build()

    # The source's DDL is decided here, in the driver, as the driver path decides it
    # (apply.following): from the batch's Relation messages, against the target's
    # shapes, split again against the shapes after it. The tasks get those shapes and
    # stage against them; the merge runs the DDL first in its transaction.
    plan = plan_following(batch, writer, expected, split)
    splitter = splits[-1]
    timings["split"] = (now := time.perf_counter()) - t
    t = now
    staging: dict[str, str] = {}
    for name, tp in plan.tables.items():
        if tp.reason() is None:
            kp = tp.key_positions if tp.mode == "key" else ()
            staging[name] = writer.staging_table(tp.target, kp or ())
    common = {
        "subscription_id": batch.subscription_id,
        "routes": dict(batch.routes),
        "targets": {name: tp.target for name, tp in plan.tables.items()},
        "relations": splitter.relations,
        "proto": _proto(batch),
        "staging": staging,
        "target_dsn": writer.dsn,
        "source_dsn": writer.source_dsn,
        # the executor checks and pins with the driver's policy, not its own environment
        "policy": policy_in_force(),
    }
    payloads = []
    for tables in splitter.parts:
        shipped = {}
        for name, items in tables.items():
            if name in staging and items.ti:
                shipped[name] = items
        if shipped:
            payloads.append(pickle.dumps({**common, "tables": shipped}, protocol=5))
    timings["ship"] = (now := time.perf_counter()) - t
    t = now
    summaries: dict[str, StageSummary] = {}
    fetched = 0
    if payloads:
        table = pa.Table.from_batches([
            pa.RecordBatch.from_pydict({"payload": [p]}, schema=pa.schema([("payload",
                                                                               pa.binary())]))
            for p in payloads])
        df = spark.createDataFrame(table)
        sc = spark.sparkContext
        sc.setJobGroup(apply_job_group(batch), f"pgsieve apply {batch.subscription_id} "
                       f"up to {batch.end_lsn}", True)
        try:
            rows = df.mapInArrow(checked(stage_partition), "result string").collect()
        finally:  # this thread's later jobs (a sync's, say) are not the batch's
            sc._jsc.clearJobGroup()
        for row in rows:
            result = json.loads(row["result"])
            fetched += int(result["fetched"])
            for name, info in result["tables"].items():
                tp = plan.tables[name]
                for k, m, lsn in info.get("fetched", ()):  # marked by the merge
                    tp.fetched[key_of_text(k)] = (m, lsn)
                if info["sequential"] and tp.sequential is None:
                    tp.sequential = info["sequential"]
                summary = summaries.setdefault(name, StageSummary())
                summary.merge(StageSummary.from_dict(info["summary"]))
    timings["spark"] = time.perf_counter() - t
    staged = {name: StagedTable(staging[name], summary)
              for name, summary in summaries.items() if name in staging}
    report = job_group_report(spark, apply_job_group(batch)) if payloads else {}
    return plan, staged, fetched, report


class SparkPlanner:
    """The :class:`~pgsieve.apply.planner.DistributedPlanner` of a SparkSession: the
    engine asks it for task slots and executors and hands it big batches to plan and
    stage (:func:`plan_and_stage`). ``spark`` is a session or a stand-in that starts one
    on first use (:class:`_LazySession`): asking is what starts it."""

    __slots__ = ("spark",)

    def __init__(self, spark: Any) -> None:
        self.spark = spark

    @classmethod
    def lazy(cls, provider: Callable[[], Any]) -> SparkPlanner:
        """The planner of the session ``provider`` returns, called on first use only."""
        return cls(_LazySession(provider))

    def task_slots(self) -> int:
        return cluster_task_slots(self.spark)

    def executors_ready(self) -> bool:
        return executors_ready(self.spark)

    def plan_and_stage(self, batch: ApplyBatch, writer: TargetWriter, expected: Lsn | None,
                       timings: dict[str, float]
                       ) -> tuple[BatchPlan, dict[str, StagedTable], int, dict[str, Any]]:
        return plan_and_stage(self.spark, batch, writer, expected, timings)

    def unavailable(self, exc: BaseException) -> bool:
        return spark_unavailable(exc)


class _LazySession:
    """Stands in for the SparkSession; the first attribute access starts (or reuses) it."""

    __slots__ = ("_provider",)

    def __init__(self, provider: Callable[[], Any]) -> None:
        self._provider = provider

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider(), name)


def spark_planner(settings: Settings) -> DistributedPlanner:
    """The planner of this process's SparkSession for ``settings`` (:func:`get_spark`),
    which starts only when a batch really needs it: small batches apply in the driver, and
    a cold JVM must not hold up a live stream."""
    return SparkPlanner.lazy(lambda: get_spark(settings))


def _proto(batch: ApplyBatch) -> int:
    for txn in batch.transactions:
        raw = raw_view(txn.changes)
        if raw is not None:
            return raw.proto
    return 4


__all__ = ["SparkPlanner", "apply_job_group", "plan_and_stage", "spark_planner",
           "stage_partition"]
