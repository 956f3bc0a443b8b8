"""one active sync job per subscription, enforced by the database

``POST /subscriptions/{id}/sync`` checked for a running job and then inserted one, and
the catch-up's "copy it again" path inserted without checking: two jobs of one
subscription could run at once. A partial unique index over the queued and running sync
jobs makes the second insert fail (the API answers ``409 sync_in_progress``).

Databases that already hold two active sync jobs of one subscription keep the oldest;
the others are marked ``cancelled`` first (their tables are picked up again by the sync
watchdog, which retries tables left in ``init``/``copy``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE_SYNC_JOB = "kind IN ('initial_sync', 'resync') AND state IN ('queued', 'running')"


def upgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text(
        f"SELECT id, subscription_id FROM jobs WHERE subscription_id IS NOT NULL "
        f"AND {ACTIVE_SYNC_JOB} ORDER BY subscription_id, created_at, id")).fetchall()
    seen: set[str] = set()
    for job_id, subscription_id in rows:
        if subscription_id in seen:
            conn.execute(sa.text(
                "UPDATE jobs SET state = 'cancelled', owner = NULL, "
                "error = 'cancelled: another sync job of the subscription was active' "
                "WHERE id = :id"), {"id": job_id})
        seen.add(subscription_id)
    op.create_index(
        "uq_jobs_active_sync", "jobs", ["subscription_id"], unique=True,
        sqlite_where=sa.text(ACTIVE_SYNC_JOB), postgresql_where=sa.text(ACTIVE_SYNC_JOB),
    )


def downgrade() -> None:
    op.drop_index("uq_jobs_active_sync", table_name="jobs")
