"""missing rows skipped: per table, UPDATEs/DELETEs whose target row was missing

The default conflict policy became ``native`` (PostgreSQL's apply worker): such a change
is skipped and counted instead of pausing the subscription. The count and the last one
skipped (operation, key, commit LSN) are kept per subscription table for ``/progress``,
``/metrics`` and the dashboard.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("subscription_tables", schema=None) as batch_op:
        batch_op.add_column(sa.Column("missing_skipped", sa.BigInteger(), nullable=False,
                                      server_default="0"))
        batch_op.add_column(sa.Column("last_missing", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("subscription_tables", schema=None) as batch_op:
        batch_op.drop_column("last_missing")
        batch_op.drop_column("missing_skipped")
