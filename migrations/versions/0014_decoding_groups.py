"""shared decoding: groups of subscriptions reading one slot (issue 58)

* ``decoding_groups``: one row per group of two or more subscriptions of a source that
  read one shared slot (its name, the union of publications, the confirmed LSN, the
  error that stopped it, the routing divergences found).
* ``subscriptions.decoding_group_id`` (SET NULL when the group goes),
  ``decoding_detached`` (false), ``decoding_refusal`` (why it could not join),
  ``decoding_joined`` (it reads the group's slot, its own dropped) and
  ``decoding_since_lsn`` (the source's WAL position when it was put in its group).
  ``decoding`` itself is an option (``subscriptions.options``): absent reads ``own``.

Revision ID: 0014_decoding_groups
Revises: 0013_alerts
Create Date: 2026-12-02 21:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_decoding_groups"
down_revision: str | None = "0013_alerts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "decoding_groups",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("source_id", sa.String(length=32), nullable=False),
        sa.Column("slot_name", sa.String(length=63), nullable=False),
        sa.Column("publication_names", sa.JSON(), nullable=False),
        sa.Column("confirmed_lsn", sa.BigInteger(), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("divergences", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["source_id"], ["sources.id"],
            name=op.f("fk_decoding_groups_source_id_sources"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_decoding_groups")),
        sa.UniqueConstraint("slot_name", name=op.f("uq_decoding_groups_slot_name")),
    )
    op.create_index(op.f("ix_decoding_groups_source_id"), "decoding_groups", ["source_id"],
                    unique=False)
    with op.batch_alter_table("subscriptions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("decoding_group_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("decoding_detached", sa.Boolean(),
                                      server_default=sa.text("false"), nullable=False))
        batch_op.add_column(sa.Column("decoding_refusal", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("decoding_joined", sa.Boolean(),
                                      server_default=sa.text("false"), nullable=False))
        batch_op.add_column(sa.Column("decoding_since_lsn", sa.BigInteger(), nullable=True))
        batch_op.create_index(batch_op.f("ix_subscriptions_decoding_group_id"),
                              ["decoding_group_id"], unique=False)
        batch_op.create_foreign_key(
            batch_op.f("fk_subscriptions_decoding_group_id_decoding_groups"),
            "decoding_groups", ["decoding_group_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("subscriptions", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("fk_subscriptions_decoding_group_id_decoding_groups"),
            type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_subscriptions_decoding_group_id"))
        batch_op.drop_column("decoding_since_lsn")
        batch_op.drop_column("decoding_joined")
        batch_op.drop_column("decoding_refusal")
        batch_op.drop_column("decoding_detached")
        batch_op.drop_column("decoding_group_id")
    op.drop_index(op.f("ix_decoding_groups_source_id"), table_name="decoding_groups")
    op.drop_table("decoding_groups")
