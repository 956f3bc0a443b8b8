"""The role matrix: which role each API route needs, in one place.

``viewer`` reads state, progress and metrics, never row data (a filter preview answers a
viewer with counts and no sample rows); ``operator`` also runs the pipelines (enable,
disable, sync, refresh, skip, subscription options) and sees sample rows; ``admin`` also
creates and deletes sources, targets, slots, publications and subscriptions, manages
tokens and reads the audit log. Keys are (method, route path as declared, without the
``/api/v1`` prefix). A route missing here needs ``admin`` (fail closed); the role-matrix
test checks that every route of the OpenAPI schema is listed.
"""

from __future__ import annotations

from pgsieve.security.tokens import Role

V, OP, A = Role.viewer, Role.operator, Role.admin

ROLE_MATRIX: dict[tuple[str, str], Role] = {
    # sources and targets
    ("GET", "/sources"): V,
    ("GET", "/sources/{source_id}"): V,
    ("POST", "/sources"): A,
    ("DELETE", "/sources/{source_id}"): A,
    ("GET", "/sources/{source_id}/health"): V,
    ("GET", "/sources/{source_id}/decoding"): V,
    ("GET", "/targets"): V,
    ("GET", "/targets/{target_id}"): V,
    ("POST", "/targets"): A,
    ("DELETE", "/targets/{target_id}"): A,
    # slots
    ("GET", "/sources/{source_id}/slots"): V,
    ("GET", "/sources/{source_id}/slots/{name}"): V,
    ("POST", "/sources/{source_id}/slots"): A,
    ("DELETE", "/sources/{source_id}/slots/{name}"): A,
    # publications and row filters
    ("GET", "/sources/{source_id}/publications"): V,
    ("GET", "/sources/{source_id}/publications/{name}"): V,
    ("POST", "/sources/{source_id}/publications"): A,
    ("PATCH", "/sources/{source_id}/publications/{name}"): A,
    # a dry run of that PATCH (rolled back on the source), counts only
    ("POST", "/sources/{source_id}/publications/{name}/plan"): OP,
    ("DELETE", "/sources/{source_id}/publications/{name}"): A,
    ("POST", "/sources/{source_id}/publications/import"): A,
    ("POST", "/sources/{source_id}/filter-preview"): V,  # sample rows: operator and up
    ("GET", "/sources/{source_id}/effective-filters"): V,
    ("GET", "/subscriptions/{subscription_id}/effective-filters"): V,
    # subscriptions: admin creates and deletes, operator runs them
    ("GET", "/subscriptions"): V,
    ("GET", "/subscriptions/{subscription_id}"): V,
    ("POST", "/subscriptions"): A,
    ("DELETE", "/subscriptions/{subscription_id}"): A,
    ("PATCH", "/subscriptions/{subscription_id}"): OP,
    ("POST", "/subscriptions/{subscription_id}/enable"): OP,
    ("POST", "/subscriptions/{subscription_id}/disable"): OP,
    ("POST", "/subscriptions/{subscription_id}/skip"): OP,
    ("POST", "/subscriptions/{subscription_id}/sync"): OP,
    ("POST", "/subscriptions/{subscription_id}/refresh"): OP,
    ("GET", "/subscriptions/{subscription_id}/progress"): V,
    ("GET", "/subscriptions/{subscription_id}/schema-changes"): V,
    ("GET", "/subscriptions/{subscription_id}/progress/history"): V,
    # jobs, metrics
    ("GET", "/jobs"): V,
    ("GET", "/jobs/{job_id}"): V,
    ("GET", "/metrics"): V,
    # tokens, audit
    ("GET", "/tokens"): A,
    ("POST", "/tokens"): A,
    ("DELETE", "/tokens/{name}"): A,
    ("GET", "/audit"): A,
    # alerts: admin manages channels and rules, everyone reads them and the alerts
    ("GET", "/alerts"): V,
    ("GET", "/alerts/channels"): V,
    ("POST", "/alerts/channels"): A,
    ("GET", "/alerts/channels/{channel_id}"): V,
    ("PATCH", "/alerts/channels/{channel_id}"): A,
    ("DELETE", "/alerts/channels/{channel_id}"): A,
    ("GET", "/alerts/rules"): V,
    ("POST", "/alerts/rules"): A,
    ("GET", "/alerts/rules/{rule_id}"): V,
    ("PATCH", "/alerts/rules/{rule_id}"): A,
    ("DELETE", "/alerts/rules/{rule_id}"): A,
}


def required_role(method: str, route_path: str) -> Role:
    """The role a route needs (``admin`` for a route not in the matrix)."""
    method = "GET" if method == "HEAD" else method
    return ROLE_MATRIX.get((method, route_path), Role.admin)
