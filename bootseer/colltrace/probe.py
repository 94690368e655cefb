"""Which node's link is slow: round trip and throughput from each node to the job's store.

Why: a slowed link shows in the rings as a whole group slowing with every op issued together
(gloo exposes no per-peer progress), so the analysis says "transport (link) or peer" and no
rank. The job's c10d store runs on the controller host; a client on each node times its own
requests over the job's network: a small ``add`` (one round trip), a ``set`` of a payload
(upload) and a ``get`` of it (download). The node whose throughput (the lower of the two) is
``factor`` times below the other nodes' median, or whose round trip is ``factor`` times
above theirs, is named.

Usage (on each node, e.g. by its agent or ``python -m bootseer.colltrace.probe``)::

    m = measure("10.0.0.5:29400", node="node-1")     # {"rtt_ms": .., "mbps": .., ...}
    slow = slow_node({"node-0": m0, "node-1": m1})  # ("node-1", "8.1 Mbit/s against ...")
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

__all__ = ["measure", "slow_node"]

PAYLOAD = 512 << 10


def measure(
    address: str,
    *,
    node: str,
    payload: int = PAYLOAD,
    repeats: int = 3,
    timeout_s: float = 60.0,
    store: Any = None,
) -> dict[str, Any]:
    """This host's round trip (ms) and throughput (Mbit/s, up and down) to the store at
    ``address`` (or through ``store``, an open client); its keys are removed after."""
    import torch.distributed  # noqa: F401 - imported before the clock starts (seconds)

    from ..robust import wire

    began = time.perf_counter()
    store = store if store is not None else wire.connect(address, timeout_s)
    connected = time.perf_counter()
    key = f"bootseer/probe/{node}"
    count = f"{key}/n"
    rtts, ups, downs = [], [], []
    data = b"\x5a" * payload
    try:
        for _ in range(5):
            t0 = time.perf_counter()
            store.add(count, 0)
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        for _ in range(repeats):
            t0 = time.perf_counter()
            store.set(key, data)
            store.add(count, 0)  # answered after the set on the same connection: it landed
            ups.append(max(time.perf_counter() - t0 - rtt, 1e-6))
            t0 = time.perf_counter()
            got = store.get(key)
            downs.append(max(time.perf_counter() - t0 - rtt, 1e-6))
            if len(got) != payload:
                raise RuntimeError(f"probe: the store gave back {len(got)} of {payload} bytes")
    finally:
        for k in (key, count):
            try:
                store.delete_key(k)
            except (RuntimeError, OSError):
                pass
    up = payload * 8 / statistics.median(ups) / 1e6
    down = payload * 8 / statistics.median(downs) / 1e6
    return {
        "node": node,
        "rtt_ms": round(rtt * 1e3, 3),
        "up_mbps": round(up, 2),
        "down_mbps": round(down, 2),
        "mbps": round(min(up, down), 2),
        "payload": payload,
        "time": time.time(),
        "connect_s": round(connected - began, 3),
        "took_s": round(time.perf_counter() - began, 3),
    }  # connect and measure


def slow_node(
    measures: dict[str, dict[str, Any]], *, factor: float = 3.0
) -> tuple[str, str] | None:
    """(node, why) for the one node whose link is ``factor`` x slower than the others'
    median (throughput or round trip), or the one node whose probe failed (``error``) while
    the others measured; else None (none, several, or fewer than 2 nodes)."""
    if len(measures) < 2:
        return None
    failed = [n for n, m in measures.items() if m.get("error")]
    if failed:  # could not even reach the store (a saturated link drops the connect)
        if len(failed) == 1 < len(measures):
            why = measures[failed[0]]["error"]
            return failed[0], f"could not measure its link to the store: {why}"
        return None
    slow = []
    for node, m in measures.items():
        others = [o for n, o in measures.items() if n != node]
        mbps = statistics.median(o["mbps"] for o in others)
        rtt = statistics.median(o["rtt_ms"] for o in others)
        if m["mbps"] * factor < mbps:
            slow.append(
                (
                    node,
                    f"{m['mbps']:.1f} Mbit/s to the store against {mbps:.1f} "
                    "(the other nodes' median)",
                )
            )
        elif m["rtt_ms"] > factor * rtt and m["rtt_ms"] - rtt > 5:
            slow.append(
                (
                    node,
                    f"round trip {m['rtt_ms']:.1f} ms to the store against "
                    f"{rtt:.1f} ms (the other nodes' median)",
                )
            )
    return slow[0] if len(slow) == 1 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bootseer.colltrace.probe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--store", required=True, help="HOST:PORT of the job's c10d store")
    p.add_argument("--node", required=True, help="this node's name (the probe's key)")
    p.add_argument("--payload", type=int, default=PAYLOAD, help="bytes per set/get")
    p.add_argument(
        "--on-stdin",
        action="store_true",
        help="connect, print 'ready', measure when a line comes on stdin",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=20.0,
        help="seconds to connect and for each request (a node that cannot: named)",
    )
    args = p.parse_args(argv)
    began = time.perf_counter()
    try:
        store = None
        if args.on_stdin:  # connected and waiting, as an agent holding its store link
            from ..robust import wire

            store = wire.connect(args.store, args.timeout)
            print("ready", flush=True)
            if not sys.stdin.readline():
                return 0  # closed without an order: nothing to measure
            began = time.perf_counter()
        print(
            json.dumps(
                measure(
                    args.store,
                    node=args.node,
                    payload=args.payload,
                    timeout_s=args.timeout,
                    store=store,
                )
            )
        )
    except (RuntimeError, OSError, ValueError) as exc:  # the result too: its link failed
        why = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
        print(f"bootseer: probe: cannot measure the link to {args.store}: {why}", file=sys.stderr)
        print(
            json.dumps(
                {
                    "node": args.node,
                    "error": why,
                    "time": time.time(),
                    "took_s": round(time.perf_counter() - began, 3),
                }
            )
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
