"""The scheduler's push thread on real sockets: a readable armed socket makes its
subscription's turn due once (one shot), an arming from an earlier turn is void, and a
delayed arming does not watch the socket before its time."""

from __future__ import annotations

import contextlib
import gc
import json
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgsieve.streaming import pushwaits
from pgsieve.streaming.pushwaits import (
    DRAIN_KEEPALIVE_BYTES,
    PEEK_BYTES,
    PushWaits,
    begins_at,
    keepalives_only,
    keepalives_seen,
    look_at,
)
from pgsieve.wire.decoder import decode_message
from pgsieve.wire.messages import Begin

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


class Harness:
    def __init__(self, use_compiled: bool) -> None:
        self.woken: queue.Queue[tuple[str, int, float]] = queue.Queue()
        self.committed: dict[str, float | None] = {}
        self.generations: dict[str, int] = {}
        self.waits = PushWaits(self._wake, self._armable, max_delay=0.1,
                               use_compiled=use_compiled)
        assert (self.waits._poll is not None) is use_compiled
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.waits.run, args=(self.stopping,),
                                       daemon=True)
        self.thread.start()

    def _wake(self, subscription_id: str, generation: int, committed: float | None) -> None:
        self.committed[subscription_id] = committed
        self.woken.put((subscription_id, generation, time.monotonic()))

    def _armable(self, subscription_id: str, generation: int) -> bool:
        return self.generations.get(subscription_id) == generation

    def next_wake(self, timeout: float = 2.0) -> tuple[str, int, float] | None:
        try:
            return self.woken.get(timeout=timeout)
        except queue.Empty:
            return None


@pytest.fixture(params=["compiled", "python"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """The push thread with its compiled wait (``_pushpoll.pyx``, built by ``make deps``:
    missing, this fails rather than skips) and with the Python reference."""
    if request.param == "compiled":
        assert pushwaits.compiled is not None, "pgsieve.streaming._pushpoll is not built"
    h = Harness(use_compiled=request.param == "compiled")
    yield h
    h.stopping.set()
    h.waits.wake()
    h.thread.join(5)
    assert not h.thread.is_alive()


Pairs = Callable[[], tuple[socket.socket, socket.socket]]


@pytest.fixture
def pair() -> Iterator[Pairs]:
    """Connected socket pairs (ours, the server's), closed after the test."""
    made: list[socket.socket] = []

    def make() -> tuple[socket.socket, socket.socket]:
        ours, server = socket.socketpair()
        made.extend((ours, server))
        return ours, server

    yield make
    for sock in made:
        sock.close()


def test_a_readable_socket_wakes_its_subscription_once(harness: Harness, pair: Pairs) -> None:
    ours, server = pair()
    harness.generations["s1"] = 3
    harness.waits.arm(time.monotonic(), "s1", 3, ours.fileno())
    assert harness.next_wake(0.3) is None  # nothing pushed yet
    server.send(b"x")
    woken = harness.next_wake()
    assert woken is not None and woken[:2] == ("s1", 3)
    # One shot: still readable (nobody read it), but not watched any more.
    server.send(b"y")
    assert harness.next_wake(0.3) is None


def test_an_arming_from_an_earlier_turn_is_void(harness: Harness, pair: Pairs) -> None:
    ours, server = pair()
    harness.generations["s1"] = 5  # a turn started since generation 4 armed it
    harness.waits.arm(time.monotonic(), "s1", 4, ours.fileno())
    server.send(b"x")
    assert harness.next_wake(0.5) is None


def test_a_delayed_arming_watches_only_from_its_time(harness: Harness, pair: Pairs) -> None:
    ours, server = pair()
    server.send(b"already here")  # e.g. keepalives that arrived during the back-off
    harness.generations["s1"] = 1
    armed_at = time.monotonic() + 0.4
    harness.waits.arm(armed_at, "s1", 1, ours.fileno())
    woken = harness.next_wake()
    assert woken is not None and woken[:2] == ("s1", 1)
    assert woken[2] >= armed_at - 0.01, "woken before its arming time"


def test_many_sockets_wake_only_the_ones_pushed_to(harness: Harness, pair: Pairs) -> None:
    pairs = {f"s{i}": pair() for i in range(50)}
    for sid, (ours, _) in pairs.items():
        harness.generations[sid] = 1
        harness.waits.arm(time.monotonic(), sid, 1, ours.fileno())
    time.sleep(0.1)
    for sid in ("s7", "s30"):
        pairs[sid][1].send(b"x")
    got = {harness.next_wake()[0] for _ in range(2)}  # type: ignore[index]
    assert got == {"s7", "s30"}
    assert harness.next_wake(0.3) is None


def keepalive(wal_end: int, reply: bool = False) -> bytes:
    return struct.pack("!cIcQQB", b"d", 22, b"k", wal_end, 0, int(reply))


def xlogdata(payload: bytes) -> bytes:
    body = b"w" + struct.pack("!QQQ", 1, 2, 3) + payload
    return b"d" + struct.pack("!I", len(body) + 4) + body


@pytest.mark.parametrize(("waiting", "only"), [
    (keepalive(1), True),
    (keepalive(1) + keepalive(2) + keepalive(3), True),
    (keepalive(1) + keepalive(2)[:9], True),  # the next keepalive arriving in parts
    (keepalive(1, reply=True), False),  # the server wants an answer: a turn answers it
    (keepalive(1) + xlogdata(b"B..."), False),
    (xlogdata(b"I..."), False),
    (b"\x00\x01garbage-from-the-middle-of-a-message", False),
])
def test_keepalives_are_told_apart_without_reading_them(waiting: bytes, only: bool,
                                                        pair: Pairs) -> None:
    ours, server = pair()
    server.send(waiting)
    time.sleep(0.05)
    assert keepalives_only(ours.fileno()) is only
    # Nothing was consumed: libpq will read every byte.
    assert ours.recv(4096, socket.MSG_DONTWAIT) == waiting


def test_keepalives_do_not_wake_a_turn_but_data_after_them_does(harness: Harness,
                                                               pair: Pairs) -> None:
    ours, server = pair()
    harness.generations["s1"] = 1
    harness.waits.arm(time.monotonic(), "s1", 1, ours.fileno(), peekable=True)
    for n in range(20):  # a steady trickle of keepalives for a second
        server.send(keepalive(n))
        time.sleep(0.05)
    assert harness.next_wake(0.01) is None
    assert harness.waits.keepalive_checks > 0
    sent = time.monotonic()
    server.send(xlogdata(b"I..."))
    woken = harness.next_wake()
    assert woken is not None and woken[:2] == ("s1", 1)
    # At once: the socket stayed watched behind the keepalives (edge-triggered), it was
    # not put aside for a while after each of them.
    assert woken[2] - sent <= 0.05, "data behind keepalives waited"
    assert harness.waits.keepalive_checks >= 15  # a look per arrival, none skipped


def test_only_what_arrived_since_the_last_look_is_parsed(pair: Pairs) -> None:
    """Keepalives known from an earlier look are not parsed again: the look returns how
    many bytes at the head are whole keepalives, and starts from there next time."""
    ours, server = pair()
    server.send(keepalive(1) + keepalive(2)[:5])
    time.sleep(0.05)
    seen = keepalives_seen(ours.fileno(), 0)
    assert seen == len(keepalive(1))
    server.send(keepalive(2)[5:] + keepalive(3))
    time.sleep(0.05)
    assert keepalives_seen(ours.fileno(), seen) == 3 * len(keepalive(1))
    server.send(xlogdata(b"I..."))
    time.sleep(0.05)
    assert keepalives_seen(ours.fileno(), 3 * len(keepalive(1))) is None
    assert ours.recv(4096, socket.MSG_DONTWAIT).endswith(xlogdata(b"I..."))


@pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "python"])
def test_a_socket_closed_while_its_readiness_is_handled_leaves_the_thread_running(
        pair: Pairs, use_compiled: bool) -> None:
    """Two armed sockets readable in the same poll; waking the first lets the other's
    subscription go (a runner closes its session) before the thread looks at it. The
    thread goes on and later pushes still wake their turns — it once ended there on
    EBADF, and every subscription of the worker fell back to the slow poll for good
    (1–2 s of lag at 50 subscriptions after some were disabled and enabled again)."""
    a, a_server = pair()
    b, b_server = pair()
    c, c_server = pair()
    woken: queue.Queue[str] = queue.Queue()
    mine = {"a": a, "b": b}

    def wake(subscription_id: str, generation: int, _committed: float | None) -> None:
        woken.put(subscription_id)
        for other, sock in mine.items():
            if other != subscription_id:
                sock.close()  # let go meanwhile: its descriptor is gone
        mine.clear()

    waits = PushWaits(wake, lambda _s, _g: True, max_delay=0.1, use_compiled=use_compiled)
    stopping = threading.Event()
    thread = threading.Thread(target=waits.run, args=(stopping,), daemon=True)
    thread.start()
    try:
        a_server.send(xlogdata(b"I..."))
        b_server.send(xlogdata(b"I..."))
        time.sleep(0.05)
        now = time.monotonic()
        waits.arm(now, "a", 1, a.fileno(), peekable=True)
        waits.arm(now, "b", 1, b.fileno(), peekable=True)
        first = woken.get(timeout=2)
        time.sleep(0.2)
        assert thread.is_alive()
        waits.arm(time.monotonic(), "c", 1, c.fileno(), peekable=True)
        c_server.send(xlogdata(b"I..."))
        seen: list[str] = []
        with contextlib.suppress(queue.Empty):  # (the closed one's wake may come first:
            while "c" not in seen:               # its turn is gone, the scheduler drops it)
                seen.append(woken.get(timeout=2))
        assert "c" in seen, f"a later push did not wake its turn (after {first}: {seen})"
    finally:
        stopping.set()
        waits.wake()
        thread.join(5)
    assert not thread.is_alive()


def test_a_closed_socket_is_not_taken_for_keepalives(pair: Pairs) -> None:
    ours, server = pair()
    server.send(keepalive(1))
    fd = ours.fileno()
    ours.close()
    assert keepalives_seen(fd, 0) is None


@pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "python"])
def test_watching_a_session_never_closes_its_socket(pair: Pairs, use_compiled: bool) -> None:
    """The thread peeks through a socket object of its own over the session's descriptor
    (made once per arming): disarmed by a wake, replaced by a new arming, dropped with
    the thread's end — the session's socket stays open and nothing is read from it."""
    ours, server = pair()
    h = Harness(use_compiled)
    try:
        h.generations["s1"] = 1
        h.waits.arm(time.monotonic(), "s1", 1, ours.fileno(), peekable=True)
        server.send(keepalive(1))
        time.sleep(0.1)
        h.waits.arm(time.monotonic(), "s1", 1, ours.fileno(), peekable=True)  # again
        time.sleep(0.1)
        server.send(xlogdata(b"I..."))
        woken = h.next_wake()
        assert woken is not None and woken[:2] == ("s1", 1)  # disarmed (one shot)
        h.waits.arm(time.monotonic(), "s1", 1, ours.fileno(), peekable=True)
        time.sleep(0.1)  # armed when the thread ends
    finally:
        h.stopping.set()
        h.waits.wake()
        h.thread.join(5)
    del h
    gc.collect()
    assert ours.fileno() >= 0
    ours.send(b"still open")
    assert server.recv(64) == b"still open"
    assert ours.recv(4096, socket.MSG_DONTWAIT) == keepalive(1) + xlogdata(b"I...")


def _captured_begin() -> tuple[bytes, Begin]:
    """A BEGIN as a real PostgreSQL 15 sent it (tests/golden), and what it decodes to."""
    messages = json.loads((GOLDEN / "basic.json").read_text())["messages"]
    raw = bytes.fromhex(messages[0]["data"])
    begin = decode_message(raw, 1)
    assert isinstance(begin, Begin)
    return raw, begin


def test_a_pushed_transaction_shows_its_commit_time_before_it_is_read() -> None:
    raw, begin = _captured_begin()
    assert begins_at(xlogdata(raw), 0) == pytest.approx(begin.commit_time.timestamp(),
                                                        abs=1e-6)
    waiting = keepalive(1) + keepalive(2) + xlogdata(raw)
    assert begins_at(waiting, 2 * 23) == begins_at(xlogdata(raw), 0)
    # Anything but an XLogData starting with a BEGIN shows no commit time.
    assert begins_at(xlogdata(b"I" + raw[1:]), 0) is None
    assert begins_at(waiting, 0) is None  # a keepalive there
    assert begins_at(xlogdata(raw)[:30], 0) is None  # not all of it arrived yet
    assert begins_at(b"\x00\x01garbage-from-the-middle-of-a-message" * 3, 0) is None


def test_a_wake_up_carries_the_commit_time_of_the_transaction_waiting(
        harness: Harness, pair: Pairs) -> None:
    """What the scheduler ranks turns by (oldest transaction first): the push thread
    peeks at the BEGIN behind any keepalives; data that starts elsewhere carries none."""
    raw, begin = _captured_begin()
    ours, server = pair()
    other, other_server = pair()
    harness.generations.update({"s1": 1, "s2": 1})
    harness.waits.arm(time.monotonic(), "s1", 1, ours.fileno(), peekable=True)
    harness.waits.arm(time.monotonic(), "s2", 1, other.fileno(), peekable=True)
    server.send(keepalive(1))
    time.sleep(0.05)
    server.send(keepalive(2) + xlogdata(raw))
    other_server.send(xlogdata(b"I..."))
    assert {harness.next_wake()[0] for _ in range(2)} == {"s1", "s2"}  # type: ignore[index]
    assert harness.committed["s1"] == pytest.approx(begin.commit_time.timestamp(), abs=1e-6)
    assert harness.committed["s2"] is None


def _pieces() -> st.SearchStrategy[bytes]:
    """What a walsender's socket may hold: keepalives (some asking for a reply),
    XLogData with a BEGIN (a real server's) or another message, and stray bytes."""
    raw, _ = _captured_begin()
    return st.one_of(
        st.integers(0, 2**40).map(keepalive),
        st.integers(0, 2**40).map(lambda n: keepalive(n, reply=True)),
        st.just(xlogdata(raw)),
        st.binary(min_size=0, max_size=60).map(lambda b: xlogdata(b"I" + b)),
        st.binary(min_size=1, max_size=40),
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(_pieces(), min_size=0, max_size=8), st.data())
def test_the_compiled_look_sees_what_the_reference_sees(pieces: list[bytes],
                                                        data: st.DataObject) -> None:
    """Any head of any mix (a cut where a message arrived in parts), from any known
    keepalive offset: the compiled wait's look and the Python one agree."""
    assert pushwaits.compiled is not None, "pgsieve.streaming._pushpoll is not built"
    waiting = b"".join(pieces)
    waiting = waiting[:data.draw(st.integers(0, len(waiting)))]
    whole = 0
    while waiting.startswith(keepalive(0)[:6], whole) and whole + 23 <= len(waiting) \
            and not waiting[whole + 22]:
        whole += 23
    seen = data.draw(st.sampled_from(range(0, whole + 1, 23)))
    assert pushwaits.compiled.look(waiting, seen) == look_at(waiting, seen)


def test_a_full_peek_is_looked_at_alike() -> None:
    """64 KiB of keepalives (a peek that may hide data behind them) then a BEGIN."""
    assert pushwaits.compiled is not None
    raw, _ = _captured_begin()
    for tail in (b"", xlogdata(raw)):
        waiting = (keepalive(7) * 3000 + tail)[:PEEK_BYTES]
        assert pushwaits.compiled.look(waiting, 0) == look_at(waiting, 0)
    waiting = (keepalive(7) * 2847 + xlogdata(raw) * 2)[:PEEK_BYTES]
    assert look_at(waiting, 0)[1] is not None
    assert pushwaits.compiled.look(waiting, 0) == look_at(waiting, 0)


def test_many_keepalives_wake_the_turn_to_read_them(harness: Harness, pair: Pairs) -> None:
    """Every look peeks from the head of the socket's queue, at a kernel cost that grows
    with what waits: past ``DRAIN_KEEPALIVE_BYTES`` of keepalives the turn is woken to let
    libpq read them (no commit time: nothing to apply)."""
    ours, server = pair()
    harness.generations["s1"] = 1
    harness.waits.arm(time.monotonic(), "s1", 1, ours.fileno(), peekable=True)
    below = DRAIN_KEEPALIVE_BYTES // 23 - 1
    for n in range(below):
        server.send(keepalive(n))
        if n % 8 == 0:
            time.sleep(0.01)
    assert harness.next_wake(0.2) is None
    server.send(keepalive(below))
    woken = harness.next_wake()
    assert woken is not None and woken[:2] == ("s1", 1)
    assert harness.committed["s1"] is None
