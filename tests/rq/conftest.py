"""Fixtures of the RQ executor tests: a Redis database of their own, real `rqworker` processes.

Every test here talks to a real Redis and starts real `manage.py rqworker` children. They use a
Redis database of their own (FANOUT_TEST_REDIS_URL, or the first free one of 15..9 on the host
of REDIS_URL, held with a file lock so that sessions side by side never share one), which is
flushed before and after each test; this process's RQ_QUEUES and every child point at it.
Processes are started in their own session (process group) and killed by group at the end.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

import pytest
from redis import Redis
from redis.exceptions import RedisError
from rq import Worker

from tests.procs import PYTHON, ROOT, child_env, wait_until

REDIS_DBS = range(15, 8, -1)  # databases the tests may take, most remote from the default 0


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of a Redis database that only this test session uses."""
    given = os.environ.get("FANOUT_TEST_REDIS_URL")
    if given:
        _ping(given)
        yield given
        return
    from django.conf import settings

    base = urlsplit(settings.REDIS_URL)
    lock_dir = Path(tempfile.gettempdir())
    for db in REDIS_DBS:
        lock = (lock_dir / f"fanout-tests-redis-{base.hostname}-{base.port or 6379}-{db}").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            url = urlunsplit(base._replace(path=f"/{db}"))
            _ping(url)
            if _live_workers(url):
                # A worker of a session that was killed outlives its lock, and takes the
                # drain jobs of whoever uses this database next.
                continue
            yield url
        finally:
            lock.close()
        return
    pytest.fail(f"every Redis database of {list(REDIS_DBS)} is taken by another test session")


def _live_workers(url: str) -> list[str]:
    """The names of RQ workers alive in this Redis database (the dead are dropped as read)."""
    conn = Redis.from_url(url, socket_connect_timeout=2)
    try:
        return [w.name for w in Worker.all(connection=conn)]
    finally:
        conn.close()


def _ping(url: str) -> None:
    conn = Redis.from_url(url, socket_connect_timeout=2)
    try:
        conn.ping()
    except RedisError as exc:
        pytest.fail(f"the RQ tests need a real Redis at {url}: {exc} (see scripts/services.sh)")
    finally:
        conn.close()


@pytest.fixture(autouse=True)
def redis(redis_url: str, settings: Any) -> Iterator[Redis]:
    """This session's Redis database, empty; RQ_QUEUES in this process point at it."""
    settings.REDIS_URL = redis_url
    settings.RQ_QUEUES = {
        name: {**config, "URL": redis_url} for name, config in settings.RQ_QUEUES.items()
    }
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@dataclass
class Child:
    """A child process in its own process group, its output in a file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    _out: TextIO

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} (pid {self.pid}) still runs after {timeout}s:\n{self.output()}"
            ) from None

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait for the child to exit; return its exit code and what it wrote on stderr."""
        return self.wait(timeout), self.output()

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def stdout(self) -> str:
        return self.log.with_suffix(".out").read_text(errors="replace")


@dataclass
class Processes:
    """Starts `manage.py` children (workers, parents) and kills every one at the end."""

    env: dict[str, str]
    redis: Redis
    tmp_path: Path
    started: list[Child] = field(default_factory=list)

    def spawn(self, command: Sequence[str], name: str, env: dict[str, str] | None = None) -> Child:
        """Start ``command`` in its own process group: stdout to NAME.out, stderr to NAME.log."""
        log = self.tmp_path / f"{name}.log"
        err = log.open("w")
        with log.with_suffix(".out").open("w") as out:
            proc = subprocess.Popen(
                list(command),
                cwd=ROOT,
                env=env or self.env,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: killpg reaches all it forks
            )
        child = Child(name, proc, log, err)
        self.started.append(child)
        return child

    def manage(
        self, args: Sequence[str], name: str | None = None, env: dict[str, str] | None = None
    ) -> Child:
        """Start ``manage.py ARGS`` (with ``env`` instead of the children's usual one)."""
        name = name or f"{args[0]}-{len(self.started)}"
        return self.spawn([PYTHON, "manage.py", *args], name, env)

    def racing(self, args_list: Sequence[Sequence[str]]) -> list[Child]:
        """Start `manage.py` children that run their commands from the same instant."""
        go = self.tmp_path / f"go-{uuid.uuid4().hex[:6]}"
        ready = [self.tmp_path / f"ready-{uuid.uuid4().hex[:6]}" for _ in args_list]
        children = [
            self.spawn(
                [PYTHON, "-m", "tests.procs", "manage", "--ready", str(r), "--go", str(go)]
                + ["--", *args],
                f"{args[0]}-{len(self.started)}",
            )
            for r, args in zip(ready, args_list, strict=True)
        ]
        wait_until(
            lambda: all(r.exists() for r in ready) or _exited(children),
            60,
            "every racing child to reach the barrier",
        )
        assert not _exited(children), "\n".join(c.output() for c in children)
        go.touch()
        return children

    def worker(self, *queues: str, args: Sequence[str] = ()) -> Child:
        """Start `manage.py rqworker QUEUES` and wait until it has registered with Redis."""
        return self.workers(1, *queues, args=args)[0]

    def workers(
        self, count: int, *queues: str, args: Sequence[str] = (), **settings: float
    ) -> list[Child]:
        """Start ``count`` workers on QUEUES (default: fanout); wait until all have registered.

        ``settings`` (e.g. FANOUT_DRAIN_SECONDS=1) start them on tests.rq.worker_settings,
        which reads those from the environment.
        """
        env = None
        if settings:
            env = {**self.env, "DJANGO_SETTINGS_MODULE": "tests.rq.worker_settings"}
            env.update({name: str(value) for name, value in settings.items()})
        started = []
        for _ in range(count):
            name = f"w{len(self.started)}-{uuid.uuid4().hex[:8]}"
            command = ["rqworker", *(queues or ("fanout",)), "--name", name, *args]
            started.append(self.manage(command, name, env))

        def registered() -> bool:
            for child in started:
                if child.proc.poll() is not None:
                    raise AssertionError(f"worker {child.name} exited:\n{child.output()}")
            return all(self.redis.exists(f"rq:worker:{c.name}") for c in started)

        wait_until(registered, 60, "the workers to register with Redis")
        return started

    def kill_all(self) -> None:
        for child in self.started:
            # RQ's forking worker puts each work horse in a process group of its own.
            for pid in _descendants(child.pid):
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            child.signal(signal.SIGKILL)
            try:
                child.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a zombie we cannot reap
                pass
            child._out.close()


def _descendants(root: int) -> list[int]:
    """Pids of every live process below ``root``, read from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces and parentheses: the fields follow the last ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        below = [pid for pid, ppid in parents.items() if ppid == parent]
        found += below
        frontier += below
    return found


def _exited(children: Sequence[Child]) -> bool:
    return any(c.proc.poll() is not None for c in children)


@pytest.fixture
def processes(
    transactional_db: Any, database_url: str, redis_url: str, redis: Redis, tmp_path: Path
) -> Iterator[Processes]:
    """Start workers and parents; all are killed (by process group) before the tables flush."""
    env = child_env(database_url, REDIS_URL=redis_url, FANOUT_LOG_LEVEL="INFO")
    env.pop("FANOUT_TEST_DATABASE_NAME", None)
    started = Processes(env, redis, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


class RedisRelay:
    """A TCP relay in front of Redis that a test can cut, as if Redis restarted.

    While cut, it drops its open connections and accepts new ones only to close them at once,
    counting them: a client's attempts to reach Redis are then observable.
    """

    def __init__(self, url: str) -> None:
        target = urlsplit(url)
        self._target = (target.hostname or "127.0.0.1", target.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        port = self._listener.getsockname()[1]
        self.url = urlunsplit(target._replace(netloc=f"127.0.0.1:{port}"))
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = threading.Event()
        self._stop = threading.Event()
        self.dropped = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self._thread.join()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            if self._cut.is_set():
                with self._lock:
                    self.dropped += 1
                client.close()
                continue
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._open |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            with self._lock:
                self._open -= {src, dst}


@pytest.fixture
def redis_relay(redis_url: str) -> Iterator[RedisRelay]:
    relay = RedisRelay(redis_url)
    try:
        yield relay
    finally:
        relay.close()
