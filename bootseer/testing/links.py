"""A cluster link: its rate and delay, applied with tc on both ends of a veth pair.

Rate: ``tbf`` (token bucket) on each end's egress, so uploads and downloads are each capped.
Delay: ``netem`` where the kernel has it (then netem carries the rate too); a kernel without
netem gets no delay from tc, and the cluster puts the delay into its per-node service proxies
instead (:class:`bootseer.testing.shaper.Shaper`), which reaches service traffic only.
:func:`qdisc_available` says which case this machine is in.
"""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass

__all__ = ["Link", "parse_rate", "qdisc_available", "shape", "tc_argv"]

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
MIN_BURST = 32 * 1024  # bytes; a burst smaller than a few packets starves TCP
QUEUE_LATENCY_MS = 100  # tbf: how long a packet may wait before it is dropped


def parse_rate(text: str) -> int:
    """Bits per second from tc's notation: ``100mbit`` (bits/s), ``10mbps`` (bytes/s, as tc
    reads it), SI prefixes k, m, g, t."""
    match = _RATE.match(text)
    if match is None:
        raise ValueError(
            f"link rate {text!r} is not a rate: write it as tc does, e.g. '100mbit' "
            "(bits/s) or '10mbps' (bytes/s)"
        )
    value = float(match[1]) * _SCALE[match[2].lower()] * (8 if match[3].lower() == "bps" else 1)
    if value < 8000:
        raise ValueError(f"link rate {text!r} is below 8kbit: tc cannot shape that slowly")
    return int(value)


@dataclass(frozen=True)
class Link:
    """What a host's link to the cluster's switch does to its traffic, in each direction.

    ``rate``: a tc rate (``"100mbit"``) or None for the veth's own speed; ``delay_ms``: added
    one way, in each direction (tc netem, else the per-node service proxies)."""

    rate: str | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate)
        if not self.delay_ms >= 0:
            raise ValueError(f"link delay_ms must be >= 0, got {self.delay_ms!r}")

    @property
    def rate_bits(self) -> int | None:
        """The rate in bits/s (None: unshaped)."""
        return None if self.rate is None else parse_rate(self.rate)

    def describe(self) -> str:
        parts = [f"{self.rate_bits / 1e6:g} Mbit/s" if self.rate else "unshaped rate"]
        if self.delay_ms:
            parts.append(f"{self.delay_ms:g} ms one way")
        return ", ".join(parts)


@functools.cache
def qdisc_available(kind: str) -> bool:
    """Whether this kernel offers qdisc ``kind`` (tried on the loopback of a throwaway network
    namespace: the host's interfaces are never touched)."""
    params = ["rate", "1mbit", "burst", "32k", "latency", "10ms"] if kind == "tbf" else []
    probe = ["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", kind, *params]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def tc_argv(dev: str, link: Link, *, netem: bool) -> list[str] | None:
    """The tc command that gives ``dev``'s egress this link (None: nothing to shape, remove the
    root qdisc). With ``netem`` False the delay is left out (the caller applies it elsewhere)."""
    rate = link.rate_bits
    delay = link.delay_ms if netem else 0.0
    if rate is None and not delay:
        return None
    base = ["tc", "qdisc", "replace", "dev", dev, "root"]
    if delay:
        return base + [
            "netem",
            "delay",
            f"{delay:g}ms",
            "limit",
            "100000",
            *(["rate", f"{rate}bit"] if rate else []),
        ]
    assert rate is not None
    burst = max(rate // 8 // 100, MIN_BURST)  # 10 ms at the rate, at least a few packets
    return base + [
        "tbf",
        "rate",
        f"{rate}bit",
        "burst",
        str(burst),
        "latency",
        f"{QUEUE_LATENCY_MS}ms",
    ]


def shape(netns: str, dev: str, link: Link) -> None:
    """Apply ``link`` to ``dev``'s egress in network namespace ``netns`` (replacing what was
    there; an unshaped link removes it).

    The old qdisc is deleted first, not changed in place: tbf splits a GSO packet larger than
    its burst when it is queued, so packets a faster setting queued (a veth's reach 64 KiB)
    could never leave a slower one with a 32 KiB burst, and a busy link slowed from 200 to
    20 Mbit/s died instead (4 of 10 link trials of bench_colltrace; alone, one TCP stream:
    0 bytes/s after an in-place change, 19.1 Mbit/s after delete and add)."""
    argv = tc_argv(dev, link, netem=qdisc_available("netem"))
    subprocess.run(
        ["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False
    )
    if argv is None:
        return
    proc = subprocess.run(
        ["tc", "-n", netns, *argv[1:]], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"tc could not shape {dev} in {netns} as {link.describe()}: {proc.stderr.strip()}"
        )
