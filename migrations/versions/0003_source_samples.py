"""source samples: a source's WAL position and slots over time (slot health, metrics)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "source_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("source_id", sa.String(length=32), nullable=False),
        sa.Column("sampled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("wal_lsn", sa.BigInteger(), nullable=True),
        sa.Column("slots", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["source_id"],
            ["sources.id"],
            name=op.f("fk_source_samples_source_id_sources"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_source_samples")),
    )
    with op.batch_alter_table("source_samples", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_source_samples_sampled_at"), ["sampled_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_source_samples_source_id"), ["source_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("source_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_source_samples_source_id"))
        batch_op.drop_index(batch_op.f("ix_source_samples_sampled_at"))
    op.drop_table("source_samples")
