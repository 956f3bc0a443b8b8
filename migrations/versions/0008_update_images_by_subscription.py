"""update images looked up by subscription and table together

A subscription's UPDATE images of one table are trimmed to their window after every
quarter window written; with only the single-column indexes, SQLite chose the table
name's — shared by every subscription of a tenant-per-subscription deployment — and each
trim read the images of all of them (7.6 ms each at 50 subscriptions, growing with their
number). The table name's own index goes: nothing looks images up by it alone.

Revision ID: 0008
Revises: 0007_security
Create Date: 2026-11-28 03:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007_security"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_update_images_subscription_table", "update_images",
                    ["subscription_id", "table_name", "id"])
    # No query looks images up by table name alone, and SQLite, given both, went on
    # choosing this one for the trim's subquery.
    op.drop_index("ix_update_images_table_name", table_name="update_images")


def downgrade() -> None:
    op.create_index("ix_update_images_table_name", "update_images", ["table_name"])
    op.drop_index("ix_update_images_subscription_table", table_name="update_images")
