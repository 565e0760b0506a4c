"""Throwaway servers a test can stop and start at will: its own Redis, its own PostgreSQL.

Outage tests run a stack on these, never on the servers the rest of the suite shares.
"""

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.stack import ROOT, free_port


class RedisServer:
    def __init__(self, directory: Path) -> None:
        if not shutil.which("redis-server"):
            pytest.fail("redis-server is needed for this test: apt-get install redis-server")
        self.port = free_port()
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        options = {
            "--port": str(self.port),
            "--bind": "127.0.0.1",
            "--save": "",
            "--appendonly": "no",
            "--dir": str(self.directory),
        }
        self.proc = subprocess.Popen(
            ["redis-server", *(part for pair in options.items() for part in pair)], stdout=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout != b"PONG\n":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class PostgresServer:
    """A PostgreSQL cluster in a temp dir, run as ``nobody`` when the tests run as root."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            pytest.fail("PostgreSQL's server binaries are needed for this test: apt-get install postgresql")
        self.bindir = Path(found[-1]).parent
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="ptc-test-pg-"))
        self.data = self.directory / "data"
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.directory, "nobody")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "-N")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.directory}'\n")

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, program: str, *args: str) -> None:
        subprocess.run([*self.as_user, str(self.bindir / program), *args], check=True, capture_output=True, cwd="/")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.directory / "log"), "-w", "-t", "30", "start")

    def stop(self) -> None:
        """Stop it as a restart would: every session is cut, committed work is kept."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class PgBouncer:
    """PgBouncer in transaction mode in front of the PostgreSQL of ``upstream`` (a URL), serving
    every database there as its user, ``pool_size`` server connections per database: a client's
    session lasts one transaction, as behind a production pooler. Run as ``nobody`` as root (it
    refuses root)."""

    def __init__(self, upstream: str, pool_size: int = 4) -> None:
        self.binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.access(self.binary, os.X_OK):
            pytest.fail("pgbouncer is needed for this test: apt-get install pgbouncer (scripts/outage-deps.sh)")
        server = urlsplit(upstream)
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="ptc-test-pgbouncer-"))
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        self.config = self.directory / "pgbouncer.ini"
        self.config.write_text(
            "[databases]\n"
            f"* = host={server.hostname} port={server.port or 5432} user={server.username or 'postgres'}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            "auth_type = any\npool_mode = transaction\n"
            f"default_pool_size = {pool_size}\nmax_client_conn = 1000\n"
            f"logfile = {self.directory / 'log'}\n"
        )
        if self.as_user:
            shutil.chown(self.directory, "nobody")
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        import psycopg

        self.proc = subprocess.Popen([*self.as_user, self.binary, str(self.config)], cwd="/", stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=1).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.directory / "log"
                    said = log.read_text(errors="replace")[-800:] if log.exists() else ""
                    self.stop()
                    raise AssertionError(f"pgbouncer did not start: {said}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


class PostgresProxy:
    """A TCP proxy in front of the PostgreSQL of ``upstream`` (a URL), whose connections a test can
    cut one at a time (``cut``): the client's ends at once, as a network's drop does, while the
    server's backend goes on with what it was doing (a statement waiting on a lock commits when the
    lock goes) and finds its client gone only as it answers: a statement committed whose reply was
    lost. Each connection is known by the port of its server side, pg_stat_activity's client_port."""

    def __init__(self, upstream: str) -> None:
        server = urlsplit(upstream)
        self.upstream = (server.hostname or "127.0.0.1", server.port or 5432)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._pairs: dict[int, tuple[socket.socket, socket.socket]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` (of the upstream server) through this proxy."""
        parts = urlsplit(url)
        return parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{self.port}").geturl()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed: stopped
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._pairs[server.getsockname()[1]] = (client, server)
            self._relay(client, server)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        """Pass a connection's bytes on, both ways (a subclass may hold some back)."""
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self, port: int) -> None:
        """Drop the connection whose server side is ``port``: its client's end at once; what its
        server answers from now on goes nowhere."""
        with self._lock:
            client, _ = self._pairs.pop(port)
        client.shutdown(socket.SHUT_RDWR)
        client.close()

    def stop(self) -> None:
        self.listener.close()
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            for end in pair:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()


def migrated_database(admin_url: str, env: dict[str, str]) -> str:
    """Create a database on the server of ``admin_url`` and migrate it with the project's own
    command; return its URL. A stack of its own needs one: two deployments never share a database."""
    import uuid

    import psycopg

    name = f"ptc_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{admin_url.rsplit('/', 1)[0]}/{name}"
    subprocess.run(
        [str(Path(os.sys.executable)), "manage.py", "migrate", "-v", "0"],
        cwd=ROOT,
        env={**env, "DATABASE_URL": url},
        check=True,
        capture_output=True,
    )
    return url


def database_drop(url: str) -> None:
    import psycopg

    admin_url, name = url.rsplit("/", 1)
    with psycopg.connect(f"{admin_url}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_keys_drop(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` on the Redis at ``url``: a run's queues, bindings and event
    streams, the Redis half of the database it drops (a shared Redis would keep them for good)."""
    import redis

    server = redis.Redis.from_url(url)
    try:
        for key in server.scan_iter(match=f"{prefix}*", count=1000):
            server.unlink(key)
    finally:
        server.close()


def api_key(env: dict[str, str], username: str, credits: int = 1000, staff: bool = False) -> str:
    """Create ``username`` (unless there is one) with a key on the stack ``env`` points at, as an
    operator would; with ``credits`` granted, and made staff with ``staff``."""
    flags = ["--create-user", "--credits", str(credits), *(["--staff"] if staff else [])]
    done = subprocess.run(
        [str(Path(os.sys.executable)), "manage.py", "create_api_key", username, *flags],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip().splitlines()[-1]
