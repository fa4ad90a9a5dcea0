"""Which messages from workers the controller accepts, and what happens to the others.

A worker proves itself once, at registration, with the run's secret (it reached the worker over
its stdin, never over a socket); from then on only the ZeroMQ identities that registered count
for that rank. Everything else is dropped, counted (dtorch.stats()["messages_rejected"]) and
logged with a rate limit: a peer that floods the reply socket gets a few log lines, never a
traceback, and the session goes on.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import time

__all__ = ["new_secret", "secret_matches", "Rejections"]

log = logging.getLogger("dtorch.controller")

LOG_EVERY_S = 10.0        # per peer: one line per this interval
LOG_BURST = 10            # all peers together: at most this many lines per interval
MAX_REMEMBERED_PEERS = 1024


def new_secret() -> str:
    return secrets.token_hex(32)


def secret_matches(offered: str, expected: str) -> bool:
    # compare_digest on bytes: it rejects non-ASCII str, and a forger chooses `offered`.
    return hmac.compare_digest(offered.encode("utf-8", "surrogatepass"), expected.encode())


class Rejections:
    """Counts dropped messages and says when one may be logged (and answered)."""

    def __init__(self, clock=time.monotonic):
        self.count = 0
        self.suppressed = 0
        self._clock = clock
        self._last_by_peer: dict[bytes, float] = {}
        self._window_start, self._window_lines = clock(), 0

    def record(self, peer: bytes, reason: str) -> bool:
        """Count one dropped message; log it if the limits allow. True if it was logged."""
        self.count += 1
        now = self._clock()
        if not self._may_log(peer, now):
            self.suppressed += 1
            return False
        more = f" ({self.suppressed} more dropped without a log line)" if self.suppressed else ""
        self.suppressed = 0
        log.warning("dropped a message from peer %s: %s%s", _peer_name(peer), reason, more)
        return True

    def _may_log(self, peer: bytes, now: float) -> bool:
        if now - self._window_start >= LOG_EVERY_S:
            self._window_start, self._window_lines = now, 0
        last = self._last_by_peer.get(peer)
        if (last is not None and now - last < LOG_EVERY_S) or self._window_lines >= LOG_BURST:
            return False
        if len(self._last_by_peer) >= MAX_REMEMBERED_PEERS:   # identities are free to invent
            self._last_by_peer.clear()
        self._last_by_peer[peer] = now
        self._window_lines += 1
        return True


def _peer_name(peer: bytes) -> str:
    text = repr(peer)
    return text if len(text) <= 40 else text[:37] + "..."
