"""A subscription whose source or target the connection policy refuses now: stopped, and
taken up again by itself once the policy allows both.

Every connection re-checks the policy (:func:`~pgsieve.platform.connpolicy.check_dsn`),
and a scheduler re-checks a held stream's two DSNs before each of its turns (its sessions
stay open between turns). A stored DSN may be refused later than it was registered: its
name now resolves to an address outside ``PGSIEVE_ALLOWED_HOSTS`` (DNS rebinding), or the
list was tightened. The subscription then stops — state ``error``, ``error_code``
``connection_not_allowed``, the policy's reason as ``error`` — rather than retrying in a
loop that would look like an outage. Unlike other errors it needs no ``enable``: each
sweep of a worker's scheduler checks the stopped ones again (names resolved, nothing sent)
and sets those the policy allows back to streaming, where the same sweep adopts them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform.connpolicy import ConnectionNotAllowed, ConnectionPolicy, check_dsn
from pgsieve.platform.credentials import SecretBox, scrub_secrets
from pgsieve.platform.db import locked
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.models import Source, Subscription, Target
from pgsieve.platform.resolver import RESOLVER
from pgsieve.platform.states import SubscriptionState

log = logging.getLogger(__name__)


#: (source DSN, target DSN, policy) -> (checked at, refusal): a stream's turn asks every
#: half second or so, and a check costs ~0.1 ms of the GIL; answers are reused as long as
#: the resolver reuses its own (so a changed answer is seen within that time).
_CHECKED: dict[tuple[str, str, ConnectionPolicy],
               tuple[float, ConnectionNotAllowed | None]] = {}
_CHECKED_MAX = 4096


def refusal(source_dsn: str, target_dsn: str,
            policy: ConnectionPolicy) -> ConnectionNotAllowed | None:
    """Why the policy refuses the subscription's source or target now (None: it allows
    both). Resolves their names; connects to nothing."""
    key = (source_dsn, target_dsn, policy)
    now = time.monotonic()
    kept = _CHECKED.get(key)
    if kept is not None and now - kept[0] < RESOLVER.ttl:
        return kept[1]
    found: ConnectionNotAllowed | None = None
    for what, dsn in (("source", source_dsn), ("target", target_dsn)):
        try:
            check_dsn(dsn, policy)
        except ConnectionNotAllowed as exc:
            found = ConnectionNotAllowed(f"the {what}: {exc.detail}")
            break
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[key] = (now, found)
    return found


def record_refused(sessions: sessionmaker[Session], subscription_id: str,
                   detail: str) -> None:
    """Stop the subscription with ``connection_not_allowed`` (see the module docstring)."""
    detail = scrub_secrets(detail)
    log.error("subscription %s stopped: the connection policy refuses it: %s",
              subscription_id, detail)
    with sessions() as session:
        sub = locked(session, Subscription, subscription_id)
        if sub is not None and sub.enabled:
            sub.state = SubscriptionState.ERROR
            sub.error = f"connection not allowed: {detail}"
            sub.error_code = ErrorCode.CONNECTION_NOT_ALLOWED
            session.commit()


def resume_allowed(sessions: sessionmaker[Session], credentials: Callable[[], SecretBox],
                   policy: ConnectionPolicy) -> list[str]:
    """Subscriptions stopped by the policy that it allows again: back to streaming.
    Returns their ids (``credentials`` is called only when some are stopped)."""
    with sessions() as session:
        stopped = session.execute(
            select(Subscription.id, Source.dsn_encrypted, Target.dsn_encrypted)
            .join(Source, Source.id == Subscription.source_id)
            .join(Target, Target.id == Subscription.target_id)
            .where(Subscription.enabled.is_(True),
                   Subscription.state == SubscriptionState.ERROR,
                   Subscription.error_code == ErrorCode.CONNECTION_NOT_ALLOWED)).all()
    if not stopped:
        return []
    box = credentials()
    allowed = [sid for sid, src, tgt in stopped
               if refusal(box.decrypt(src), box.decrypt(tgt), policy) is None]
    resumed: list[str] = []
    for subscription_id in allowed:
        with sessions() as session:
            sub = locked(session, Subscription, subscription_id)
            if (sub is None or not sub.enabled or sub.state != SubscriptionState.ERROR
                    or sub.error_code != ErrorCode.CONNECTION_NOT_ALLOWED):
                continue  # enabled, disabled or deleted meanwhile
            sub.state, sub.error, sub.error_code = SubscriptionState.STREAMING, None, None
            session.commit()
            resumed.append(subscription_id)
            log.info("subscription %s: the connection policy allows it again; resuming",
                     subscription_id)
    return resumed
