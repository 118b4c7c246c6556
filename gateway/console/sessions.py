"""The console's sessions: kept on the server, in this process's memory; the browser holds a random id.

A login (the admin key, checked against `--admin-key-hash`) opens a session: a random id in an
HttpOnly, SameSite=Strict cookie scoped to /ui (Secure over https). The session holds the admin
key, with which the console calls the admin API on the admin's behalf (it is never sent back to
the browser), a CSRF token that every change must carry, and its times. It ends at logout,
`idle_s` after its last use, or `max_s` after its login, whichever comes first. The store keys
sessions by a hash of the id, so what it holds is not the cookies themselves.

Sessions live in the gateway that opened them: behind a load balancer without sticky sessions, or
after a restart, the console asks to log in again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

COOKIE = "batchgate_console"
COOKIE_PATH = "/ui"
# Most sessions kept at once; past it, the oldest goes (a session is opened only with the key).
MAX_SESSIONS = 1000
# Failed logins allowed per client address per window, before a 429.
MAX_FAILED_LOGINS, FAILED_LOGIN_WINDOW_S = 10, 60.0


@dataclass
class Session:
    admin_key: str
    csrf_token: str
    created_at: float
    last_seen: float
    # One-shot notices for the next page (after a change: what it did, or why it failed).
    flashes: list[tuple[str, str]] = field(default_factory=list)

    def flash(self, kind: str, text: str) -> None:
        self.flashes.append((kind, text))

    def take_flashes(self) -> list[tuple[str, str]]:
        taken, self.flashes = self.flashes, []
        return taken

    def csrf_ok(self, token: str | None) -> bool:
        """Whether a change carries this session's token (compared in constant time)."""
        return token is not None and hmac.compare_digest(token.encode(), self.csrf_token.encode())


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class Sessions:
    """Open sessions by the hash of their id. `clock`: seconds, monotonic (tests move it)."""

    def __init__(self, idle_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.max_s = max_s
        self.clock = clock
        self._open: dict[str, Session] = {}

    def open(self, admin_key: str) -> tuple[str, Session]:
        """A new session (a fresh id at every login: no id chosen before it is ever trusted);
        returns the id, the cookie's value, and the session."""
        now = self.clock()
        self._expire(now)
        while len(self._open) >= MAX_SESSIONS:
            oldest = min(self._open, key=lambda d: self._open[d].created_at)
            del self._open[oldest]
        session_id = secrets.token_urlsafe(32)
        session = Session(admin_key, secrets.token_urlsafe(32), now, now)
        self._open[_digest(session_id)] = session
        return session_id, session

    def find(self, session_id: str | None, *, touch: bool = True) -> Session | None:
        """The live session of a cookie's id, or None (no id, unknown, ended or expired: an expired
        one is dropped). `touch`: this use counts as activity (a page's automatic refresh does not,
        so a forgotten tab still times out)."""
        if not session_id:
            return None
        digest = _digest(session_id)
        session = self._open.get(digest)
        if session is None:
            return None
        now = self.clock()
        if self._ended(session, now):
            del self._open[digest]
            return None
        if touch:
            session.last_seen = now
        return session

    def close(self, session_id: str | None) -> None:
        if session_id:
            self._open.pop(_digest(session_id), None)

    def __len__(self) -> int:
        return len(self._open)

    def _ended(self, session: Session, now: float) -> bool:
        return now - session.last_seen >= self.idle_s or now - session.created_at >= self.max_s

    def _expire(self, now: float) -> None:
        for digest in [d for d, s in self._open.items() if self._ended(s, now)]:
            del self._open[digest]


class LoginThrottle:
    """Failed logins per client address in a sliding window: past `MAX_FAILED_LOGINS` within
    `FAILED_LOGIN_WINDOW_S`, a login is refused before the key is looked at."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, client: str) -> deque[float]:
        now = self.clock()
        failures = self._failures.setdefault(client, deque())
        while failures and now - failures[0] >= FAILED_LOGIN_WINDOW_S:
            failures.popleft()
        if not failures:
            del self._failures[client]
        return failures

    def blocked(self, client: str) -> bool:
        return len(self._recent(client)) >= MAX_FAILED_LOGINS

    def failed(self, client: str) -> None:
        now = self.clock()
        if len(self._failures) >= MAX_SESSIONS * 10:  # many addresses: forget those past the window
            for stale in [c for c, f in self._failures.items() if now - f[-1] >= FAILED_LOGIN_WINDOW_S]:
                del self._failures[stale]
        self._recent(client)
        self._failures.setdefault(client, deque()).append(now)
