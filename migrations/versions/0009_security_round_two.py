"""security, second round: a per-install KDF salt, audit records written before the
change and failed authentications counted per minute, a subscription's error code

* ``installation`` (one row): the salt this deployment's credential key is derived with
  (32 random bytes, made here) and when the keys of earlier versions stopped decrypting.
  A store that holds no credential yet retires them at once; otherwise ``pgsieve secrets
  rotate`` does, after re-encrypting every DSN with the salted key.
* ``audit_events.status`` may be NULL (a change is recorded before it is made, its
  outcome after); ``count`` and ``aggregate_key`` keep failed authentications as one
  record per route, client and minute.
* ``subscriptions.error_code``: ``connection_not_allowed`` for a subscription the
  connection policy stopped (resumed by itself once it allows it again).

Revision ID: 0009_security_round_two
Revises: 0008
Create Date: 2027-01-12 09:00:00.000000
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0009_security_round_two"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    installation = op.create_table(
        "installation",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("kdf_salt", sa.String(64), nullable=False),
        sa.Column("legacy_keys_retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_installation")),
    )
    conn = op.get_bind()
    stored = sum(int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())
                 for table in ("sources", "targets"))
    now = datetime.now(UTC)
    op.bulk_insert(installation, [{
        "id": 1, "kdf_salt": secrets.token_hex(32), "created_at": now,
        # nothing was encrypted with the old keys: they never decrypt here
        "legacy_keys_retired_at": now if stored == 0 else None,
    }])
    with op.batch_alter_table("audit_events") as batch:
        batch.alter_column("status", existing_type=sa.Integer(), nullable=True)
        batch.add_column(sa.Column("count", sa.Integer(), server_default="1", nullable=False))
        batch.add_column(sa.Column("aggregate_key", sa.String(400), nullable=True))
        batch.create_unique_constraint(op.f("uq_audit_events_aggregate_key"),
                                       ["aggregate_key"])
    with op.batch_alter_table("subscriptions") as batch:
        batch.add_column(sa.Column("error_code", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("subscriptions") as batch:
        batch.drop_column("error_code")
    op.execute("DELETE FROM audit_events WHERE status IS NULL")
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_constraint(op.f("uq_audit_events_aggregate_key"), type_="unique")
        batch.drop_column("aggregate_key")
        batch.drop_column("count")
        batch.alter_column("status", existing_type=sa.Integer(), nullable=False)
    op.drop_table("installation")
