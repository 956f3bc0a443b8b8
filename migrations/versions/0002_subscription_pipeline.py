"""subscription pipeline: consumer locks, update images, sync partitions, progress fields

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 00:34:44.087331
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "consumer_locks",
        sa.Column("subscription_id", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cycles", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscriptions.id"],
            name=op.f("fk_consumer_locks_subscription_id_subscriptions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("subscription_id", name=op.f("pk_consumer_locks")),
    )
    op.create_table(
        "update_images",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("subscription_id", sa.String(length=32), nullable=False),
        sa.Column("table_name", sa.String(length=130), nullable=False),
        sa.Column("lsn", sa.BigInteger(), nullable=False),
        sa.Column("old_kind", sa.String(length=1), nullable=True),
        sa.Column("old", sa.JSON(), nullable=True),
        sa.Column("new", sa.JSON(), nullable=False),
        sa.Column("captured_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscriptions.id"],
            name=op.f("fk_update_images_subscription_id_subscriptions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_update_images")),
    )
    with op.batch_alter_table("update_images", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_update_images_subscription_id"), ["subscription_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_update_images_table_name"), ["table_name"], unique=False
        )

    op.create_table(
        "sync_partitions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("subscription_id", sa.String(length=32), nullable=False),
        sa.Column("table_name", sa.String(length=130), nullable=False),
        sa.Column("partition_no", sa.Integer(), nullable=False),
        sa.Column("lower", sa.Text(), nullable=True),
        sa.Column("upper", sa.Text(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("rows", sa.BigInteger(), nullable=False),
        sa.Column("snapshot_lsn", sa.BigInteger(), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_sync_partitions_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscriptions.id"],
            name=op.f("fk_sync_partitions_subscription_id_subscriptions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sync_partitions")),
        sa.UniqueConstraint(
            "job_id", "table_name", "partition_no", name=op.f("uq_sync_partitions_job_id")
        ),
    )
    with op.batch_alter_table("sync_partitions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_sync_partitions_job_id"), ["job_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_sync_partitions_subscription_id"), ["subscription_id"], unique=False
        )

    with op.batch_alter_table("subscription_tables", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("conflicts", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("sync_slot", sa.String(length=63), nullable=True))
        batch_op.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch_op.add_column(
            sa.Column(
                "updated_at",
                sa.DateTime(timezone=True),
                nullable=False,
                server_default=sa.func.current_timestamp(),
            )
        )

    with op.batch_alter_table("subscriptions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("slot_owned", sa.Boolean(), nullable=False, server_default=sa.true())
        )
        batch_op.add_column(sa.Column("consistent_lsn", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("source_lsn", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column("oldest_unapplied_commit_ts", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(sa.Column("caught_up_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("stats", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("subscriptions", schema=None) as batch_op:
        batch_op.drop_column("stats")
        batch_op.drop_column("caught_up_at")
        batch_op.drop_column("oldest_unapplied_commit_ts")
        batch_op.drop_column("source_lsn")
        batch_op.drop_column("consistent_lsn")
        batch_op.drop_column("slot_owned")

    with op.batch_alter_table("subscription_tables", schema=None) as batch_op:
        batch_op.drop_column("updated_at")
        batch_op.drop_column("error")
        batch_op.drop_column("sync_slot")
        batch_op.drop_column("conflicts")

    with op.batch_alter_table("sync_partitions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sync_partitions_subscription_id"))
        batch_op.drop_index(batch_op.f("ix_sync_partitions_job_id"))

    op.drop_table("sync_partitions")
    with op.batch_alter_table("update_images", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_update_images_table_name"))
        batch_op.drop_index(batch_op.f("ix_update_images_subscription_id"))

    op.drop_table("update_images")
    op.drop_table("consumer_locks")
