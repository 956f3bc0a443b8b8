"""The push thread's cost per keepalive: its compiled wait against the Python reference.

    .venv/bin/python -m bench.pushwait_bench [--sessions 50] [--every 0.005] [--seconds 10]
        [--repeat 2]

A walsender whose client is behind its decoding position sends a keepalive for every
commit at the source (``bench.scale_bench --source-commit sync``: ~8,000 a second over 50
streams). This replays that load on loopback TCP sessions: a separate process sends a
keepalive on each of ``--sessions`` sockets every ``--every`` seconds (spread), and one
``PushWaits`` thread watches them all, armed as the scheduler arms them; every 50 ms a
BEGIN arrives on one socket, and a wake-up's "turn" reads the socket and arms it again.
Printed per implementation, alternating in this process: the watching process's CPU (and
the kernel's part of it), per look, the looks counted and the wake-ups; then the ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import struct
import threading
import time
from typing import Any

from bench import report as bench_report
from pgsieve.streaming import pushwaits
from pgsieve.streaming.pushwaits import PushWaits

KEEPALIVE = struct.pack("!cIcQQB", b"d", 22, b"k", 1, 0, 0)
BEGIN = bytes.fromhex("420000000001947bf8000303d600ebc77d000002d6")  # tests/golden basic
XLOG = b"d" + struct.pack("!I", 4 + 25 + len(BEGIN)) + b"w" + struct.pack("!QQQ", 1, 2, 3) + BEGIN


def _send(socks: list[socket.socket], every: float, seconds: float,
          data_every: float) -> None:
    """The walsenders: a keepalive per socket per ``every`` (spread), a BEGIN on the next
    socket every ``data_every`` seconds."""
    start = time.monotonic()
    n = len(socks)
    step = every / n
    i = 0
    next_data = start + data_every
    while (now := time.monotonic()) - start < seconds:
        socks[i % n].send(KEEPALIVE)
        if now >= next_data:
            socks[(i + 1) % n].send(XLOG)
            next_data += data_every
        i += 1
        pause = start + i * step - time.monotonic()
        if pause > 0:
            time.sleep(pause)


def _tcp_pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    """Loopback TCP connections (ours, the walsender's), as replication sessions are: a
    socket pair's small buffer would fill with the keepalives no turn reads."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        out = []
        for _ in range(n):
            ours = socket.create_connection(server.getsockname())
            theirs, _ = server.accept()
            theirs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as a walsender
            out.append((ours, theirs))
    return out


def run(use_compiled: bool, sessions: int, every: float, seconds: float) -> dict[str, Any]:
    pairs = _tcp_pairs(sessions)
    ours = [p[0] for p in pairs]
    theirs = [p[1] for p in pairs]
    generations = dict.fromkeys(range(sessions), 0)
    waits: PushWaits

    def wake(subscription_id: str, generation: int, committed: float | None) -> None:
        k = int(subscription_id)
        sock = ours[k]
        sock.recv(1 << 16)  # the turn: reads everything, the BEGIN with it
        generations[k] += 1
        waits.arm(time.monotonic(), subscription_id, generations[k], sock.fileno(),
                  peekable=True)

    waits = PushWaits(wake, lambda s, g: generations[int(s)] == g, max_delay=0.5,
                      use_compiled=use_compiled)
    stopping = threading.Event()
    thread = threading.Thread(target=waits.run, args=(stopping,), daemon=True)
    thread.start()
    for k, sock in enumerate(ours):
        waits.arm(time.monotonic(), str(k), 0, sock.fileno(), peekable=True)
    sender = multiprocessing.get_context("fork").Process(
        target=_send, args=(theirs, every, seconds, 0.05))
    t0 = os.times()
    cpu0 = time.process_time()
    wall0 = time.monotonic()
    sender.start()
    sender.join()
    time.sleep(0.1)
    cpu = time.process_time() - cpu0
    t1 = os.times()
    wall = time.monotonic() - wall0
    stopping.set()
    waits.wake()
    thread.join(5)
    for a, b in pairs:
        a.close()
        b.close()
    looks = waits.keepalive_checks + waits.wakeups
    return {"system": (t1.system - t0.system) / wall, "cpu_per_s": cpu / wall,
            "looks": looks, "wakeups": waits.wakeups, "us_per_look": cpu / max(1, looks) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--every", type=float, default=0.005)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=2)
    bench_report.add_argument(parser)
    args = parser.parse_args()
    if pushwaits.compiled is None:
        raise SystemExit("pgsieve.streaming._pushpoll is not built: run `make deps`")
    print(f"{args.sessions} sessions, a keepalive each every {args.every * 1000:g} ms "
          f"({args.sessions / args.every:,.0f} a second), {args.seconds:g} s per run, "
          f"pid {os.getpid()}\n")
    print("| wait | run | CPU (cores) | of which the kernel's | looks | µs of CPU per look "
          "| wake-ups (data, or keepalives to read) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    results: dict[str, list[dict[str, Any]]] = {"compiled": [], "python": []}
    for r in range(args.repeat):
        for name in ("python", "compiled"):
            out = run(name == "compiled", args.sessions, args.every, args.seconds)
            results[name].append(out)
            print(f"| {name} | {r + 1} | {out['cpu_per_s']:.3f} | {out['system']:.3f} | "
                  f"{out['looks']:,} | "
                  f"{out['us_per_look']:.1f} | {out['wakeups']} |")
    best = {k: min(x["us_per_look"] for x in v) for k, v in results.items()}
    cores = {k: min(x["cpu_per_s"] for x in v) for k, v in results.items()}
    print(f"\nper look: python {best['python']:.1f} µs, compiled {best['compiled']:.1f} µs "
          f"({best['python'] / best['compiled']:.1f}× less); the process's CPU "
          f"{cores['python']:.3f} → {cores['compiled']:.3f} cores")
    bench_report.write(
        "pushwait_bench",
        {**{f"{k}.us_per_look": v for k, v in best.items()},
         **{f"{k}.cpu_cores": v for k, v in cores.items()}},
        ratios={"python_over_compiled_per_look": best["python"] / best["compiled"]},
        notes={"sessions": args.sessions, "every_s": args.every, "seconds": args.seconds},
        path=args.report)


if __name__ == "__main__":
    main()
