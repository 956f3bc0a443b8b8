"""What API requests may hold on the databases at once, and whose policy they obey.

Every request runs in a :class:`~pgsieve.platform.connpolicy.ConnectionScope` set by the
security middleware: the app's own connection policy (so every connection a request
opens, however deep in the domain code, is checked and pinned with the settings this API
was started with) and an admission check run before each connection.

Admission bounds what low roles can make the API hold on production databases (40
parallel viewer calls used to hold 40 connections on a source): a request that opens a
connection takes one of its token's ``PGSIEVE_API_CONCURRENCY_PER_TOKEN`` places and one
of the database's ``PGSIEVE_API_CONCURRENCY_PER_DATABASE`` places (a database is a
source or target, by the address and database name the policy pinned), and keeps them
until the request ends; more connections of the same request to the same database take
nothing more. A request that finds no place is refused at once — 429
``too_many_requests`` with ``Retry-After`` — rather than queued: a queue would hold one of
the API's threads per waiting call. The places are counted per API process.
"""

from __future__ import annotations

import threading
from collections import Counter

from pgsieve.platform.errors import TooManyRequests

#: Seconds a refused caller is told to wait (the requests it races with are short).
RETRY_AFTER = 1


class ConnectionLimits:
    """The places of one API process (see the module docstring)."""

    def __init__(self, per_token: int, per_database: int) -> None:
        self.per_token = per_token
        self.per_database = per_database
        self._mutex = threading.Lock()
        self._tokens: Counter[str] = Counter()
        self._databases: Counter[str] = Counter()

    def for_request(self, caller: str) -> RequestPlaces:
        return RequestPlaces(self, caller)

    def in_use(self) -> tuple[dict[str, int], dict[str, int]]:
        """Places taken now, per token and per database (for tests and metrics)."""
        with self._mutex:
            return (dict(+self._tokens), dict(+self._databases))


class RequestPlaces:
    """The places one request holds; :meth:`admit` is the scope's admission check."""

    def __init__(self, limits: ConnectionLimits, caller: str) -> None:
        self.limits = limits
        self.caller = caller
        self._token = False
        self._databases: set[str] = set()

    def admit(self, database: str) -> None:
        limits = self.limits
        with limits._mutex:
            if database in self._databases:
                return
            if not self._token and limits._tokens[self.caller] >= limits.per_token:
                raise TooManyRequests(
                    f"token '{self.caller}' has {limits.per_token} requests using databases "
                    "already (PGSIEVE_API_CONCURRENCY_PER_TOKEN); try again shortly",
                    retry_after=RETRY_AFTER)
            if limits._databases[database] >= limits.per_database:
                raise TooManyRequests(
                    f"this database serves {limits.per_database} API requests already "
                    "(PGSIEVE_API_CONCURRENCY_PER_DATABASE); try again shortly",
                    retry_after=RETRY_AFTER)
            if not self._token:
                limits._tokens[self.caller] += 1
                self._token = True
            limits._databases[database] += 1
            self._databases.add(database)

    def release(self) -> None:
        limits = self.limits
        with limits._mutex:
            if self._token:
                limits._tokens[self.caller] -= 1
                self._token = False
            for database in self._databases:
                limits._databases[database] -= 1
            self._databases.clear()


class FailedAuthLimiter:
    """Failed authentications per client address and minute: the first
    ``PGSIEVE_FAILED_AUTH_PER_MINUTE`` get 401, the rest of that minute 429 with
    ``Retry-After`` (the seconds left in it). A valid token is never refused here."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._mutex = threading.Lock()
        self._minute = -1
        self._counts: Counter[str] = Counter()

    def note(self, client: str, now: float) -> int | None:
        """Count one failure of ``client`` at ``now`` (Unix seconds); None: answer 401,
        else the seconds to put in ``Retry-After``."""
        minute = int(now // 60)
        with self._mutex:
            if minute != self._minute:  # a new minute: everyone starts again
                self._minute, self._counts = minute, Counter()
            self._counts[client] += 1
            if self._counts[client] <= self.per_minute:
                return None
        return max(1, 60 - int(now % 60))
