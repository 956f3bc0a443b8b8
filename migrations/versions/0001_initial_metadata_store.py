"""initial metadata store

Revision ID: 0001
Revises:
Create Date: 2026-11-22 05:38:21.296940
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "sources",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("dsn_encrypted", sa.Text(), nullable=False),
        sa.Column("server_version", sa.String(length=64), nullable=False),
        sa.Column("server_version_num", sa.Integer(), nullable=False),
        sa.Column("wal_level", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sources")),
        sa.UniqueConstraint("name", name=op.f("uq_sources_name")),
    )
    op.create_table(
        "targets",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("dsn_encrypted", sa.Text(), nullable=False),
        sa.Column("server_version", sa.String(length=64), nullable=False),
        sa.Column("server_version_num", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_targets")),
        sa.UniqueConstraint("name", name=op.f("uq_targets_name")),
    )
    op.create_table(
        "worker_heartbeats",
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("beat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("worker", name=op.f("pk_worker_heartbeats")),
    )
    op.create_table(
        "publications",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("source_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("all_tables", sa.Boolean(), nullable=False),
        sa.Column("schemas", sa.JSON(), nullable=False),
        sa.Column("publish", sa.JSON(), nullable=False),
        sa.Column("publish_via_partition_root", sa.Boolean(), nullable=False),
        sa.Column("managed", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["source_id"],
            ["sources.id"],
            name=op.f("fk_publications_source_id_sources"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_publications")),
        sa.UniqueConstraint("source_id", "name", name=op.f("uq_publications_source_id")),
    )
    op.create_table(
        "slots",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("source_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("plugin", sa.String(length=63), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["source_id"],
            ["sources.id"],
            name=op.f("fk_slots_source_id_sources"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_slots")),
        sa.UniqueConstraint("source_id", "name", name=op.f("uq_slots_source_id")),
    )
    op.create_table(
        "subscriptions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("source_id", sa.String(length=32), nullable=False),
        sa.Column("target_id", sa.String(length=32), nullable=False),
        sa.Column("publications", sa.JSON(), nullable=False),
        sa.Column("slot_name", sa.String(length=63), nullable=False),
        sa.Column("copy_data", sa.Boolean(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("received_lsn", sa.BigInteger(), nullable=True),
        sa.Column("applied_lsn", sa.BigInteger(), nullable=True),
        sa.Column("last_commit_ts", sa.DateTime(timezone=True), nullable=True),
        sa.Column("skip_lsn", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["source_id"],
            ["sources.id"],
            name=op.f("fk_subscriptions_source_id_sources"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["target_id"],
            ["targets.id"],
            name=op.f("fk_subscriptions_target_id_targets"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_subscriptions")),
        sa.UniqueConstraint("name", name=op.f("uq_subscriptions_name")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("subscription_id", sa.String(length=32), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("progress_done", sa.BigInteger(), nullable=False),
        sa.Column("progress_total", sa.BigInteger(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscriptions.id"],
            name=op.f("fk_jobs_subscription_id_subscriptions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_table(
        "progress_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("subscription_id", sa.String(length=32), nullable=False),
        sa.Column("sampled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source_lsn", sa.BigInteger(), nullable=True),
        sa.Column("received_lsn", sa.BigInteger(), nullable=True),
        sa.Column("applied_lsn", sa.BigInteger(), nullable=True),
        sa.Column("lag_bytes", sa.BigInteger(), nullable=True),
        sa.Column("lag_seconds", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscriptions.id"],
            name=op.f("fk_progress_samples_subscription_id_subscriptions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_progress_samples")),
    )
    with op.batch_alter_table("progress_samples", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_progress_samples_sampled_at"), ["sampled_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_progress_samples_subscription_id"), ["subscription_id"], unique=False
        )

    op.create_table(
        "publication_tables",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("publication_id", sa.String(length=32), nullable=False),
        sa.Column("table_name", sa.String(length=130), nullable=False),
        sa.Column("where", sa.Text(), nullable=True),
        sa.Column("columns", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["publication_id"],
            ["publications.id"],
            name=op.f("fk_publication_tables_publication_id_publications"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_publication_tables")),
        sa.UniqueConstraint(
            "publication_id", "table_name", name=op.f("uq_publication_tables_publication_id")
        ),
    )
    op.create_table(
        "subscription_tables",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("subscription_id", sa.String(length=32), nullable=False),
        sa.Column("table_name", sa.String(length=130), nullable=False),
        sa.Column("sync_state", sa.String(length=16), nullable=False),
        sa.Column("sync_lsn", sa.BigInteger(), nullable=True),
        sa.Column("rows_copied", sa.BigInteger(), nullable=False),
        sa.Column("rows_total", sa.BigInteger(), nullable=True),
        sa.Column("inserts", sa.BigInteger(), nullable=False),
        sa.Column("updates", sa.BigInteger(), nullable=False),
        sa.Column("deletes", sa.BigInteger(), nullable=False),
        sa.Column("truncates", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscriptions.id"],
            name=op.f("fk_subscription_tables_subscription_id_subscriptions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_subscription_tables")),
        sa.UniqueConstraint(
            "subscription_id", "table_name", name=op.f("uq_subscription_tables_subscription_id")
        ),
    )


def downgrade() -> None:

    op.drop_table("subscription_tables")
    op.drop_table("publication_tables")
    with op.batch_alter_table("progress_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_progress_samples_subscription_id"))
        batch_op.drop_index(batch_op.f("ix_progress_samples_sampled_at"))

    op.drop_table("progress_samples")
    op.drop_table("jobs")
    op.drop_table("subscriptions")
    op.drop_table("slots")
    op.drop_table("publications")
    op.drop_table("worker_heartbeats")
    op.drop_table("targets")
    op.drop_table("sources")
