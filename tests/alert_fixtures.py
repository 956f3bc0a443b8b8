"""Metadata rows the alert tests stand on: a source, a target and subscriptions written
straight into a real (migrated) metadata store, as the API and workers would leave
them."""

from __future__ import annotations

from sqlalchemy.orm import Session

from pgsieve.platform.models import Source, Subscription, SubscriptionTable, Target


def add_subscription(session: Session, name: str = "orders", *, source_id: str | None = None,
                     enabled: bool = True, tables: tuple[str, ...] = ("public.t",)) -> str:
    """A subscription (and a source and target when ``source_id`` is None); its id."""
    if source_id is None:
        source = Source(name=f"src-{name}", dsn_encrypted="x", server_version="15.0",
                        server_version_num=150000, wal_level="logical")
        session.add(source)
        session.flush()
        source_id = source.id
    target = Target(name=f"tgt-{name}", dsn_encrypted="x", server_version="15.0",
                    server_version_num=150000)
    session.add(target)
    session.flush()
    sub = Subscription(name=name, source_id=source_id, target_id=target.id,
                       publications=["p"], slot_name=f"slot_{name}", enabled=enabled,
                       state="streaming")
    sub.tables = [SubscriptionTable(table_name=t) for t in tables]
    session.add(sub)
    session.commit()
    return sub.id
