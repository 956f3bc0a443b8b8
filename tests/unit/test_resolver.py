"""Issue 54, hole 5: one host name whose DNS server does not answer cannot make the
policy refuse every other source (the shared 4-thread resolver it used to fill)."""

from __future__ import annotations

import threading
import time

import pytest

from pgsieve.platform.connpolicy import ConnectionNotAllowed, ConnectionPolicy, check_dsn
from tests.dnsfake import fake_dns


def test_a_name_that_never_answers_delays_only_its_own_callers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    policy = ConnectionPolicy.parse("10.0.0.0/8", connect_timeout=20)
    with fake_dns(monkeypatch) as dns:
        dns.set("slow.test", "10.0.0.1")
        dns.set("fast.test", "10.0.0.2")
        released = dns.hold("slow.test")
        refused: list[str] = []

        def slow() -> None:
            try:
                check_dsn("host=slow.test user=u", policy)
            except ConnectionNotAllowed:
                refused.append("slow")

        callers = [threading.Thread(target=slow) for _ in range(40)]
        try:
            for thread in callers:
                thread.start()
            deadline = time.monotonic() + 30
            while "slow.test" not in dns.asked:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # 40 callers wait for slow.test; another name still answers at once
            started = time.monotonic()
            pinned = check_dsn("host=fast.test user=u", policy)
            assert "hostaddr=10.0.0.2" in pinned
            assert time.monotonic() - started < 5
            # ... and slow.test was asked once, not once per caller
            assert dns.asked.count("slow.test") == 1
        finally:
            released.set()
            for thread in callers:
                thread.join(30)
        assert refused == []  # they all got the answer when it came
