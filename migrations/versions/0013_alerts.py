"""alerts: channels, rules, alerts and every delivery attempt

* ``alert_channels``: webhooks (URL encrypted, a masked copy to show; the signing
  secret encrypted).
* ``alert_rules`` and ``alert_rule_channels`` (RESTRICT on the channel: a channel a
  rule sends to is not deleted).
* ``alerts``: one row per (rule, subject) episode; a partial unique index keeps one
  open (pending or firing) alert per (rule, subject), so two evaluations racing cannot
  open it twice.
* ``alert_deliveries`` (an event to a channel, with its fixed body) and
  ``alert_delivery_attempts`` (each HTTP attempt: status code, error).

Revision ID: 0013_alerts
Revises: 0010_schema_changes
Create Date: 2026-12-02 17:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_alerts"
down_revision: str | None = "0010_schema_changes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OPEN_ALERT = "state IN ('pending', 'firing')"


def _time(name: str, nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "alert_channels",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("url_encrypted", sa.Text(), nullable=False),
        sa.Column("url_masked", sa.Text(), nullable=False),
        sa.Column("secret_encrypted", sa.Text(), nullable=True),
        _time("created_at"),
        _time("updated_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_channels")),
        sa.UniqueConstraint("name", name=op.f("uq_alert_channels_name")),
    )
    op.create_table(
        "alert_rules",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("threshold", sa.Double(), nullable=True),
        sa.Column("for_seconds", sa.Integer(), nullable=True),
        sa.Column("repeat_seconds", sa.Integer(), nullable=True),
        sa.Column("subscription_id", sa.String(length=32), nullable=True),
        _time("created_at"),
        _time("updated_at"),
        sa.ForeignKeyConstraint(
            ["subscription_id"], ["subscriptions.id"],
            name=op.f("fk_alert_rules_subscription_id_subscriptions"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_rules")),
        sa.UniqueConstraint("name", name=op.f("uq_alert_rules_name")),
    )
    op.create_index(op.f("ix_alert_rules_subscription_id"), "alert_rules",
                    ["subscription_id"], unique=False)
    op.create_table(
        "alert_rule_channels",
        sa.Column("rule_id", sa.String(length=32), nullable=False),
        sa.Column("channel_id", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["rule_id"], ["alert_rules.id"],
            name=op.f("fk_alert_rule_channels_rule_id_alert_rules"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["channel_id"], ["alert_channels.id"],
            name=op.f("fk_alert_rule_channels_channel_id_alert_channels"),
            ondelete="RESTRICT"),
        sa.PrimaryKeyConstraint("rule_id", "channel_id", name=op.f("pk_alert_rule_channels")),
    )
    op.create_index(op.f("ix_alert_rule_channels_channel_id"), "alert_rule_channels",
                    ["channel_id"], unique=False)
    op.create_table(
        "alerts",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("rule_id", sa.String(length=32), nullable=False),
        sa.Column("subject", sa.String(length=300), nullable=False),
        sa.Column("subscription_id", sa.String(length=32), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        _time("since"),
        _time("started_at", True),
        _time("resolved_at", True),
        _time("notified_at", True),
        sa.ForeignKeyConstraint(
            ["rule_id"], ["alert_rules.id"],
            name=op.f("fk_alerts_rule_id_alert_rules"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["subscription_id"], ["subscriptions.id"],
            name=op.f("fk_alerts_subscription_id_subscriptions"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    op.create_index(op.f("ix_alerts_rule_id"), "alerts", ["rule_id"], unique=False)
    op.create_index(op.f("ix_alerts_subscription_id"), "alerts", ["subscription_id"],
                    unique=False)
    op.create_index("uq_alerts_open", "alerts", ["rule_id", "subject"], unique=True,
                    sqlite_where=sa.text(OPEN_ALERT), postgresql_where=sa.text(OPEN_ALERT))
    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("alert_id", sa.String(length=32), nullable=False),
        sa.Column("channel_id", sa.String(length=32), nullable=True),
        sa.Column("channel_name", sa.String(length=63), nullable=False),
        sa.Column("event", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _time("next_attempt_at", True),
        sa.Column("payload", sa.JSON(), nullable=False),
        _time("created_at"),
        sa.ForeignKeyConstraint(
            ["alert_id"], ["alerts.id"],
            name=op.f("fk_alert_deliveries_alert_id_alerts"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["channel_id"], ["alert_channels.id"],
            name=op.f("fk_alert_deliveries_channel_id_alert_channels"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_deliveries")),
    )
    for column in ("alert_id", "channel_id", "next_attempt_at"):
        op.create_index(op.f(f"ix_alert_deliveries_{column}"), "alert_deliveries", [column],
                        unique=False)
    op.create_table(
        "alert_delivery_attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("delivery_id", sa.Integer(), nullable=False),
        _time("at"),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["delivery_id"], ["alert_deliveries.id"],
            name=op.f("fk_alert_delivery_attempts_delivery_id_alert_deliveries"),
            ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_delivery_attempts")),
    )
    op.create_index(op.f("ix_alert_delivery_attempts_delivery_id"),
                    "alert_delivery_attempts", ["delivery_id"], unique=False)


def downgrade() -> None:
    op.drop_table("alert_delivery_attempts")
    op.drop_table("alert_deliveries")
    op.drop_index("uq_alerts_open", table_name="alerts")
    op.drop_table("alerts")
    op.drop_table("alert_rule_channels")
    op.drop_table("alert_rules")
    op.drop_table("alert_channels")
