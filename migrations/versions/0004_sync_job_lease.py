"""sync job lease: the worker running a job and its last heartbeat

A sync job runs for minutes to hours; if its worker dies the broker redelivers the task
only after its visibility timeout (an hour). The lease lets the sync watchdog (beat) see a
dead runner within seconds and hand the job to another worker, and lets two deliveries of
one job agree on a single runner (compare-and-swap on owner + heartbeat).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 01:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner", sa.String(length=200), nullable=True))
        batch_op.add_column(
            sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("heartbeat_at")
        batch_op.drop_column("owner")
