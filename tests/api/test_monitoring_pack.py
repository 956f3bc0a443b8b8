"""The monitoring pack in ``monitoring/``: the Prometheus alert rules and the Grafana
dashboard reference only what ``/metrics`` really exports.

Every PromQL expression is parsed by ``promql-parser`` (the Prometheus grammar, from the
registry); the metric names it selects must be series of a family a live ``/metrics``
lists (a counter's ``_total``, a histogram's ``_bucket``/``_sum``/``_count``), and the
labels it matches, groups or joins on must be labels those series carry — read from a
scrape of a store with a subscription, a table, a slot, a worker and jobs in it (the
``world`` of test_metrics). A renamed metric or label breaks this test, not a user's
paging at 3 a.m.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from pgsieve.platform.models import SchemaChangeRecord
from tests.api.test_metrics import world  # noqa: F401  (the fixture)

PACK = Path(__file__).resolve().parents[2] / "monitoring"
RULES = PACK / "prometheus" / "pgsieve-alerts.yml"
DASHBOARD = PACK / "grafana" / "pgsieve-dashboard.json"
#: Series Prometheus makes itself (the scrape's health), not pgsieve.
PROMETHEUS_OWN = {"up": {"job", "instance"}}
#: The built-in alert kinds (SPEC: /alerts/rules) the rules stand for; routing_divergence
#: needs shared decoding.
KINDS = {"consumer_dead", "lag_seconds", "lag_bytes", "slot_wal_status", "slot_invalidation",
         "table_stopped", "sync_failed", "worker_stale", "endpoint_unreachable"}


@dataclass
class Selected:
    """What one expression reads: metric names, and the labels it names."""

    metrics: set[str] = field(default_factory=set)
    matchers: set[tuple[str, str]] = field(default_factory=set)
    """(metric, label) of each label matcher."""
    grouping: set[str] = field(default_factory=set)
    """labels of by/without/on/ignoring."""


def _walk(node: Any, out: Selected) -> None:
    if isinstance(node, promql_parser.MatrixSelector):
        _walk(node.vector_selector, out)
    elif isinstance(node, promql_parser.VectorSelector):
        assert node.name, f"a selector without a metric name: {node}"
        out.metrics.add(node.name)
        out.matchers |= {(node.name, m.name) for m in node.matchers.matchers}
    elif isinstance(node, promql_parser.BinaryExpr):
        if node.modifier is not None and node.modifier.matching is not None:
            out.grouping |= set(node.modifier.matching.labels)
        _walk(node.lhs, out)
        _walk(node.rhs, out)
    elif isinstance(node, promql_parser.AggregateExpr):
        if node.modifier is not None:
            out.grouping |= set(node.modifier.labels)
        _walk(node.expr, out)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            _walk(arg, out)
    elif isinstance(node, promql_parser.ParenExpr | promql_parser.UnaryExpr |
                    promql_parser.SubqueryExpr):
        _walk(node.expr, out)
    else:
        assert isinstance(node, promql_parser.NumberLiteral | promql_parser.StringLiteral), (
            type(node), node)


def selected(expr: str) -> Selected:
    grafana_free = expr.replace("$subscription", "x")  # the dashboard's variable
    out = Selected()
    _walk(promql_parser.parse(grafana_free), out)
    return out


@pytest.fixture
def exported(client, world, metadata_engine) -> dict[str, set[str]]:  # noqa: F811
    """Each series name ``/metrics`` can export → the labels its samples carry."""
    with Session(metadata_engine) as session:  # a family world has no sample of
        session.add(SchemaChangeRecord(
            subscription_id=world["sub_id"], table_name="public.orders", lsn=1,
            change="add_column", column_name="c", action="applied", ddl=[]))
        session.commit()
    r = client.get("/metrics")
    assert r.status_code == 200
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(r.text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count", "")}.get(family.type, ("",))
        for suffix in suffixes:
            series.setdefault(family.name + suffix, set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    for name, labels in PROMETHEUS_OWN.items():
        series[name] = set(labels)
    return series


def _rules() -> Iterator[dict[str, Any]]:
    spec = yaml.safe_load(RULES.read_text())
    for group in spec["groups"]:
        yield from group["rules"]


def _dashboard_exprs() -> Iterator[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            definition = variable["definition"]
            assert definition.startswith("label_values(") and definition.endswith(")")
            metric, label = (p.strip() for p in definition[13:-1].split(","))
            yield variable["name"], f"group by ({label}) ({metric})"


def _check(where: str, expr: str, exported: dict[str, set[str]]) -> None:
    reads = selected(expr)
    unknown = reads.metrics - set(exported)
    assert not unknown, f"{where}: {expr!r} reads metrics /metrics does not export: {unknown}"
    for metric, label in reads.matchers:
        if metric in PROMETHEUS_OWN or exported[metric]:  # families with samples here
            assert label in exported[metric] | {"__name__"}, (where, metric, label)
    every_label = set().union(*(exported[m] for m in reads.metrics)) | {"le"}
    assert reads.grouping <= every_label, (where, reads.grouping - every_label)


def test_every_alert_rule_parses_and_reads_real_metrics(exported):
    rules = list(_rules())
    assert len({r["alert"] for r in rules}) == len(rules), "alert names must be unique"
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["annotations"]["summary"] and rule["labels"]["severity"] in (
            "warning", "critical")
        _check(rule["alert"], rule["expr"], exported)


def test_the_rules_cover_every_built_in_alert_kind():
    kinds = {r["labels"].get("kind") for r in _rules()}
    assert kinds >= KINDS, KINDS - kinds


def test_every_dashboard_query_reads_real_metrics(exported):
    queries = list(_dashboard_exprs())
    assert len(queries) >= 20
    for where, expr in queries:
        _check(where, expr, exported)
    # what the issue asks it to show, per subscription
    text = DASHBOARD.read_text()
    for metric in ("pgsieve_subscription_lag_seconds", "pgsieve_subscription_applied_changes",
                   "pgsieve_slot_retained_wal_bytes", "pgsieve_consumer_alive",
                   "pgsieve_worker_heartbeat_age_seconds"):
        assert metric in text


def test_the_checker_catches_a_wrong_name_and_a_wrong_label(exported):
    with pytest.raises(AssertionError, match="does not export"):
        _check("t", "pgsieve_subscription_lag_second > 1", exported)
    with pytest.raises(AssertionError):
        _check("t", 'pgsieve_subscription_lag_seconds{tenant="a"} > 1', exported)
    with pytest.raises(AssertionError):
        _check("t", "sum by (tenant) (pgsieve_subscription_lag_seconds)", exported)
    with pytest.raises(ValueError):
        selected("rate(pgsieve_jobs[5m]")
