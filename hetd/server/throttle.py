"""Failed token checks counted per client address, so that guessing a token is slow however many
requests a guesser sends at once: after ``failures`` wrong tokens within ``window_s`` an address
is answered 429 (with ``Retry-After``) until its window ends, without its token being checked.

One :class:`AuthThrottle` serves the worker endpoint, the admin API and the dashboard's login of a
daemon. It never waits (nothing blocks the event loop) and holds at most ``max_entries``
addresses. An IPv6 client counts by its /64, which one machine usually has whole.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable

MAX_ENTRIES = 4096


def client_key(address: str | None) -> str:
    """What limits are kept per: the address, for IPv6 its /64 (``"?"`` when unknown)."""
    if not address:
        return "?"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d is a.b.c.d
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class AuthThrottle:
    """Per-address counts of failed token checks in fixed windows of ``window_s``."""

    def __init__(
        self,
        failures: int = 100,
        window_s: float = 60.0,
        *,
        max_entries: int = MAX_ENTRIES,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures, self.window_s = failures, window_s
        self._max, self._now = max_entries, now
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (window start, failures in it)

    def retry_after(self, address: str | None) -> int | None:
        """Whole seconds until ``address`` may try again; None: it may now."""
        entry = self._seen.get(client_key(address))
        if entry is None or entry[1] < self.failures:
            return None
        left = entry[0] + self.window_s - self._now()
        return math.ceil(left) if left > 0 else None

    def failed(self, address: str | None) -> bool:
        """Note one wrong token from ``address``; True when this one used up its window."""
        key, now = client_key(address), self._now()
        start, count = self._seen.get(key, (now, 0))
        if now - start >= self.window_s:
            start, count = now, 0
        if self._seen.pop(key, None) is None and len(self._seen) >= self._max:
            self._forget(now)
        self._seen[key] = (start, count + 1)  # (last in order: the oldest go first)
        return count + 1 == self.failures

    def _forget(self, now: float) -> None:
        """Make room: drop ended windows, then (a scan of many addresses) the oldest."""
        self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
        while len(self._seen) >= self._max:
            del self._seen[next(iter(self._seen))]
