"""schema changes: what each subscription's stream did about the source's DDL

* ``schema_changes``: one row per source DDL met on one column of one table (ADD COLUMN
  followed, a type widened, a change stopped with ``schema_change_unsupported``), unique
  per (subscription, table, LSN, change, column) so that delivering the target's journal
  again after a crash records nothing twice.

Revision ID: 0010_schema_changes
Revises: 0009_security_round_two
Create Date: 2027-02-02 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_schema_changes"
down_revision: str | None = "0009_security_round_two"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "schema_changes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("subscription_id", sa.String(length=32), nullable=False),
        sa.Column("table_name", sa.String(length=130), nullable=False),
        sa.Column("lsn", sa.BigInteger(), nullable=False),
        sa.Column("change", sa.String(length=32), nullable=False),
        sa.Column("column_name", sa.String(length=130), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("code", sa.String(length=64), nullable=True),
        sa.Column("ddl", sa.JSON(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscriptions.id"],
            name=op.f("fk_schema_changes_subscription_id_subscriptions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schema_changes")),
        sa.UniqueConstraint("subscription_id", "table_name", "lsn", "change", "column_name",
                            name=op.f("uq_schema_changes_subscription_id")),
    )
    with op.batch_alter_table("schema_changes", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_schema_changes_subscription_id"), ["subscription_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("schema_changes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_schema_changes_subscription_id"))
    op.drop_table("schema_changes")
