#!/usr/bin/env python3
"""Find or start the services celery-fence's tests, demo and benchmarks use.

    python3 scripts/services.py postgres|redis|rabbitmq [--port PORT] [--require]
    python3 scripts/services.py stop-throwaway

Prints the service's URL on stdout. When the service cannot be had, it prints one line on
stderr that says what is missing and how to get it, and exits with status 3 ("warning:") or,
with ``--require``, status 1 ("error:"), so a caller can tell an optional service from a
required one.

PostgreSQL: ``CELERY_FENCE_DATABASE_URL`` when it is set (an error when it does not answer);
else 127.0.0.1:PORT (user ``postgres``, database ``test``, created if missing); else the
machine's cluster on that port started with ``pg_ctlcluster``; else a throwaway cluster from
the installed server binaries, on a free port in a temporary directory, reused by later calls
until ``stop-throwaway``.
Redis: 127.0.0.1:PORT answering PING, else ``redis-server`` started as a daemon. RabbitMQ:
127.0.0.1:PORT answering the AMQP 0-9-1 handshake, else ``rabbitmq-server -detached``.

Standard library only: it runs with the system ``python3`` before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

HOST = "127.0.0.1"
DEFAULT_PORTS = {"postgres": 5432, "redis": 6379, "rabbitmq": 5672}
PG_USER = "postgres"
PG_DATABASE = "test"
#: Where the throwaway cluster is recorded: a directory of the user's own, which no one else
#: can write, so what it records (a directory to delete, programs to run) is the user's.
STATE_DIR = Path(tempfile.gettempdir()) / f"celery-fence-services-{os.getuid()}"
STATE_FILE = STATE_DIR / "postgres-throwaway.json"
PROBE_TIMEOUT = 3.0


class Unavailable(Exception):
    """The service cannot be had; the message says what is missing and how to get it."""


# -- small helpers ------------------------------------------------------------------------------


def note(message: str) -> None:
    """Progress for the person running the script; stdout carries only the URL."""
    print(f"services: {message}", file=sys.stderr, flush=True)


def wait_for(check: Callable[[], bool], seconds: float, interval: float = 0.25) -> bool:
    """Poll ``check`` until it is true or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def run(command: list[str], *, user: str | None = None, cwd: str | None = None) -> None:
    """Run ``command`` (as ``user`` when given); raise Unavailable with its output on failure.

    The output goes to a file, not a pipe: a daemon that keeps its parent's descriptors open
    must not keep this call waiting.
    """
    if user is not None:
        if shutil.which("runuser"):
            command = ["runuser", "-u", user, "--", *command]
        else:
            command = ["su", "-s", "/bin/sh", user, "-c", shlex.join(command)]
    with tempfile.TemporaryFile("w+") as output:
        try:
            subprocess.run(
                command,
                cwd=cwd,
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=120,
            )
        except subprocess.CalledProcessError as exc:
            output.seek(0)
            last = output.read().strip().splitlines()[-1:] or ["no output"]
            raise Unavailable(f"`{shlex.join(command)}` failed: {last[0]}") from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"`{shlex.join(command)}` failed: {exc}") from exc


def connect(host: str, port: int) -> socket.socket:
    """A TCP connection, or a Unix-socket one when ``host`` is a directory (libpq's rule)."""
    if host.startswith("/"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(PROBE_TIMEOUT)
        sock.connect(f"{host}/.s.PGSQL.{port}")
        return sock
    return socket.create_connection((host, port), timeout=PROBE_TIMEOUT)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# -- PostgreSQL: a minimal frontend/backend protocol client (startup, trust auth, simple query) --


@dataclass
class PgAnswer:
    """What a server said to a startup message: ``ok`` (trust), ``password`` (it asks for one,
    which a real client will send) or ``error`` with the server's SQLSTATE and message."""

    status: str
    sqlstate: str = ""
    message: str = ""


def _pg_send(sock: socket.socket, kind: bytes, body: bytes) -> None:
    sock.sendall(kind + struct.pack("!I", len(body) + 4) + body)


def _pg_read(sock: socket.socket) -> tuple[bytes, bytes]:
    kind = recv_exact(sock, 1)
    (length,) = struct.unpack("!I", recv_exact(sock, 4))
    return kind, recv_exact(sock, length - 4)


def _pg_error(body: bytes) -> PgAnswer:
    fields = {part[:1]: part[1:].decode(errors="replace") for part in body.split(b"\0") if part}
    return PgAnswer("error", fields.get(b"C", ""), fields.get(b"M", "unknown error"))


def _pg_until_ready(sock: socket.socket, *, starting: bool) -> PgAnswer:
    """Read messages up to ReadyForQuery. An error while ``starting`` is fatal (the server
    closes the connection after it); after a query, ReadyForQuery still follows it."""
    answer = PgAnswer("ok")
    while True:
        kind, body = _pg_read(sock)
        if kind == b"E" and answer.status == "ok":
            answer = _pg_error(body)
            if starting:
                return answer
        elif kind == b"Z":
            return answer


def pg_session(
    host: str, port: int, user: str, database: str, statements: tuple[str, ...] = ()
) -> PgAnswer:
    """Start a session and run ``statements`` (simple query protocol, trust auth only)."""
    try:
        with connect(host, port) as sock:
            params = f"user\0{user}\0database\0{database}\0\0".encode()
            sock.sendall(struct.pack("!II", len(params) + 8, 196608) + params)
            kind, body = _pg_read(sock)
            if kind == b"E":
                return _pg_error(body)
            if kind != b"R":
                return PgAnswer("error", message=f"unexpected reply {kind!r}: not PostgreSQL?")
            if struct.unpack("!I", body[:4])[0] != 0:
                return PgAnswer("password")
            answer = _pg_until_ready(sock, starting=True)
            for statement in statements:
                if answer.status != "ok":
                    break
                _pg_send(sock, b"Q", statement.encode() + b"\0")
                answer = _pg_until_ready(sock, starting=False)
            _pg_send(sock, b"X", b"")
            return answer
    except (OSError, ConnectionError, struct.error) as exc:
        return PgAnswer("error", message=str(exc) or type(exc).__name__)


def pg_url(port: int) -> str:
    return f"postgresql://{PG_USER}@{HOST}:{port}/{PG_DATABASE}"


def pg_local(port: int) -> str | None:
    """The URL of a trust-auth server on 127.0.0.1:port with database ``test`` (created when
    missing), or None when nothing usable answers there."""
    answer = pg_session(HOST, port, PG_USER, PG_DATABASE)
    if answer.status == "error" and answer.sqlstate == "3D000":  # invalid_catalog_name
        note(f"creating database {PG_DATABASE} on {HOST}:{port}")
        answer = pg_session(HOST, port, PG_USER, "postgres", (f"CREATE DATABASE {PG_DATABASE}",))
    return pg_url(port) if answer.status == "ok" else None


def pg_target(url: str) -> tuple[str, int, str, str]:
    """The host, port, user and database a ``postgresql://`` URL names, its query's ``host``,
    ``port``, ``user`` and ``dbname`` before the URL's own (as libpq takes them); ValueError for
    anything else."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql") and not parts.scheme.startswith(
        "postgresql+"
    ):
        raise ValueError(f"scheme {parts.scheme!r}")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    host = query.get("host") or parts.hostname or "/var/run/postgresql"
    port = int(query.get("port") or parts.port or 5432)
    if not 0 < port < 65536:
        raise ValueError(f"port {port}")
    user = query.get("user") or unquote(parts.username or "") or pwd.getpwuid(os.getuid()).pw_name
    database = query.get("dbname") or unquote(parts.path.lstrip("/")) or user
    return host, port, user, database


def pg_from_environment() -> str | None:
    """CELERY_FENCE_DATABASE_URL when it is set; an error when its server does not answer (a
    server chosen on purpose is not replaced by another one)."""
    url = os.environ.get("CELERY_FENCE_DATABASE_URL")
    if not url:
        return None
    try:
        host, port, user, database = pg_target(url)
    except ValueError as exc:
        raise Unavailable(
            f"CELERY_FENCE_DATABASE_URL is not a postgresql://user@host:port/database URL ({exc})"
        ) from None
    answer = pg_session(host, port, user, database)
    if answer.status in ("ok", "password"):
        return url
    if (answer.sqlstate or "").startswith("28"):  # invalid_authorization_specification
        # The server answers, but refuses this check's plain session (it wants SSL, or knows
        # no such role): the URL is used as given, and its own connections say what is wrong.
        note(f"CELERY_FENCE_DATABASE_URL: the server refused a plain session ({answer.message})")
        return url
    if answer.sqlstate == "3D000":  # invalid_catalog_name
        raise Unavailable(
            "CELERY_FENCE_DATABASE_URL names a database its server does not have "
            f"({answer.message}): create it (createdb -h {host} -U {user} {database}), or unset "
            "the variable"
        )
    raise Unavailable(
        f"CELERY_FENCE_DATABASE_URL does not answer ({answer.message}): start that server, "
        "or unset the variable to use (or start) one on this machine"
    )


def cluster_port(conf: Path) -> int:
    match = re.search(r"^\s*port\s*=\s*(\d+)", conf.read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 5432


def pg_start_cluster(port: int) -> str | None:
    """Start the machine's own cluster that listens on ``port`` (Debian's pg_ctlcluster)."""
    etc = Path("/etc/postgresql")
    if not shutil.which("pg_ctlcluster") or not etc.is_dir():
        return None
    for conf in sorted(etc.glob("*/main/postgresql.conf")):
        version = conf.parent.parent.name
        if cluster_port(conf) != port:
            continue
        note(f"starting PostgreSQL cluster {version}/main")
        try:
            run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"])
        except Unavailable as exc:
            note(str(exc))
            continue
        if wait_for(lambda: pg_local(port) is not None, 30):
            return pg_url(port)
    return None


def server_bindir() -> Path | None:
    """The directory holding initdb and pg_ctl: the newest /usr/lib/postgresql/N/bin, or PATH."""
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda path: int(path.parent.parent.name) if path.parent.parent.name.isdigit() else 0,
        reverse=True,
    )
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve())
    for initdb in candidates:
        if (initdb.parent / "pg_ctl").exists():
            return initdb.parent
    return None


def cluster_user() -> tuple[str | None, int, int]:
    """Who runs the throwaway cluster: initdb refuses root, so root hands it to postgres
    (or nobody); anyone else runs it as themselves."""
    if os.geteuid() != 0:
        return None, os.getuid(), os.getgid()
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return name, entry.pw_uid, entry.pw_gid
    raise Unavailable("running as root and neither a postgres nor a nobody user exists for initdb")


def pg_ctl(state: dict[str, object], *args: str) -> None:
    """Run the throwaway cluster's pg_ctl on its data directory, as the cluster's user."""
    base = str(state["base"])
    program = str(Path(str(state["bindir"])) / "pg_ctl")
    run([program, "-D", f"{base}/data", *args], user=state_user(state), cwd=base)


def pg_ctl_start(state: dict[str, object]) -> None:
    base = state["base"]
    options = (
        f"-c listen_addresses={HOST} -c port={state['port']} -c unix_socket_directories={base}"
    )
    pg_ctl(state, "-l", f"{base}/postgres.log", "-w", "-t", "60", "-o", options, "start")


def port_of(state: dict[str, object]) -> int:
    return int(str(state["port"]))


def state_user(state: dict[str, object]) -> str | None:
    return None if state["user"] is None else str(state["user"])


def state_file() -> Path:
    """STATE_FILE, in a directory created private to this user; refused when the directory is
    a link, someone else owns it or others can write to it."""
    STATE_DIR.mkdir(mode=0o700, exist_ok=True)
    info = STATE_DIR.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise Unavailable(
            f"{STATE_DIR} is not a directory of this user's that only it can write: remove it"
        )
    return STATE_FILE


def load_state() -> dict[str, object] | None:
    try:
        return dict(json.loads(state_file().read_text()))
    except (OSError, ValueError):
        return None


def pg_recorded_throwaway() -> str | None:
    """A throwaway cluster an earlier call started, restarted if it stopped."""
    state = load_state()
    if state is None:
        return None
    port = port_of(state)
    if pg_local(port) is not None:
        return pg_url(port)
    if not Path(str(state["base"]), "data").is_dir():
        STATE_FILE.unlink(missing_ok=True)
        return None
    note(f"restarting the throwaway PostgreSQL cluster in {state['base']}")
    try:
        pg_ctl_start(state)
    except Unavailable as exc:
        note(f"{exc}; starting a new one")
        stop_throwaway()
        return None
    return pg_local(port)


def pg_start_throwaway(port: int) -> str:
    """initdb a trust-auth cluster in a temporary directory and start it on a free port
    (``port`` is only named in the message when no server binaries exist)."""
    bindir = server_bindir()
    if bindir is None:
        raise Unavailable(
            f"nothing usable answers on {HOST}:{port} (user {PG_USER}, trust, database "
            f"{PG_DATABASE}) and no server binaries (initdb, pg_ctl) were found: "
            "apt-get install postgresql, or set CELERY_FENCE_DATABASE_URL"
        )
    user, uid, gid = cluster_user()
    base = tempfile.mkdtemp(prefix="celery-fence-pg-")
    os.chown(base, uid, gid)
    state: dict[str, object] = {
        "base": base,
        "bindir": str(bindir),
        "user": user,
        "port": free_port(),
    }
    note(f"starting a throwaway PostgreSQL cluster in {base} (as {user or 'current user'})")
    state_file().write_text(json.dumps(state))
    try:
        initdb_flags = ["--auth=trust", "--no-sync", "--no-locale", "-E", "UTF8"]
        run(
            [str(bindir / "initdb"), "-D", f"{base}/data", "-U", PG_USER, *initdb_flags],
            user=user,
            cwd=base,
        )
        pg_ctl_start(state)
        url = pg_local(port_of(state))
        if url is None:
            raise Unavailable(f"the throwaway cluster in {base} started but does not answer")
    except Unavailable:
        stop_throwaway()
        raise
    note("stop it with: python3 scripts/services.py stop-throwaway")
    return url


def postgres(port: int) -> str:
    return (
        pg_from_environment()
        or pg_local(port)
        or pg_recorded_throwaway()
        or pg_start_cluster(port)
        or pg_start_throwaway(port)
    )


def postmaster_of(data: Path) -> int | None:
    """The pid in ``data``'s postmaster.pid when that process is a postmaster still running in
    ``data`` (its working directory), else None: a pid left by one that died may be another
    process's by now."""
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
        running_in = Path(os.readlink(f"/proc/{pid}/cwd"))
    except (OSError, ValueError, IndexError):
        return None
    return pid if running_in == data.resolve() else None


def stop_throwaway() -> str:
    """Stop the recorded throwaway cluster and delete its directory."""
    state = load_state()
    if state is None:
        return "no throwaway PostgreSQL cluster is recorded"
    base = Path(str(state["base"]))
    pid_file = base / "data" / "postmaster.pid"
    try:
        pg_ctl(state, "-m", "fast", "-w", "stop")
    except Unavailable as exc:
        pid = postmaster_of(base / "data")
        if pid is not None:
            note(f"{exc}; sending SIGTERM to postmaster {pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                wait_for(lambda: not pid_file.exists(), 30)
    shutil.rmtree(base, ignore_errors=True)
    STATE_FILE.unlink(missing_ok=True)
    return f"stopped the throwaway PostgreSQL cluster in {base}"


# -- Redis ---------------------------------------------------------------------------------------


def redis_answers(port: int) -> bool:
    """PING in RESP on a raw socket."""
    try:
        with socket.create_connection((HOST, port), timeout=PROBE_TIMEOUT) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def writable_dir(preferred: str) -> str:
    """``preferred`` when it can be created and written, else a temporary directory."""
    try:
        os.makedirs(preferred, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="celery-fence-redis-")


def redis(port: int) -> str:
    url = f"redis://{HOST}:{port}/0"
    if redis_answers(port):
        return url
    server = shutil.which("redis-server")
    if server is None:
        raise Unavailable(
            f"Redis does not answer on {HOST}:{port} and redis-server is not installed "
            "(apt-get install redis-server)"
        )
    note(f"starting redis-server on {HOST}:{port}")
    data_dir = writable_dir("/var/lib/redis")
    log_file = os.path.join(writable_dir("/var/log/redis"), "ci.log")
    flags = ["--daemonize", "yes", "--bind", HOST, "-::1", "--port", str(port), "--save", ""]
    run([server, *flags, "--appendonly", "no", "--dir", data_dir, "--logfile", log_file])
    if not wait_for(lambda: redis_answers(port), 15):
        raise Unavailable(
            f"redis-server started but does not answer on {HOST}:{port}: see {log_file}"
        )
    return url


# -- RabbitMQ ------------------------------------------------------------------------------------


def amqp_answers(port: int) -> bool:
    """Send the AMQP 0-9-1 protocol header; a broker answers with a Connection.Start frame
    (a method frame on channel 0 whose class and method ids are 10 and 10)."""
    try:
        with socket.create_connection((HOST, port), timeout=PROBE_TIMEOUT) as sock:
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            header = recv_exact(sock, 11)
    except (OSError, ConnectionError):
        return False
    return header[0] == 1 and header[1:3] == b"\x00\x00" and header[7:11] == b"\x00\x0a\x00\x0a"


def rabbitmq(port: int) -> str:
    url = f"amqp://guest:guest@{HOST}:{port}//"
    if amqp_answers(port):
        return url
    server = shutil.which("rabbitmq-server")
    if server is None:
        raise Unavailable(
            f"RabbitMQ does not answer on {HOST}:{port} and rabbitmq-server is not installed "
            "(apt-get install rabbitmq-server)"
        )
    note(f"starting rabbitmq-server (waiting up to 60 s for {HOST}:{port})")
    os.environ["RABBITMQ_NODE_PORT"] = str(port)
    run([server, "-detached"])
    if not wait_for(lambda: amqp_answers(port), 60, interval=1.0):
        raise Unavailable(f"rabbitmq-server was started but {HOST}:{port} did not answer in 60 s")
    return url


# -- command line --------------------------------------------------------------------------------

SERVICES: dict[str, Callable[[int], str]] = {
    "postgres": postgres,
    "redis": redis,
    "rabbitmq": rabbitmq,
}
NAMES = {"postgres": "PostgreSQL", "redis": "Redis", "rabbitmq": "RabbitMQ"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("service", choices=[*SERVICES, "stop-throwaway"])
    parser.add_argument("--port", type=int, help="the local port to look at (default: standard)")
    parser.add_argument(
        "--require", action="store_true", help="a missing service is an error (exit 1, not 3)"
    )
    args = parser.parse_args(argv)
    if args.service == "stop-throwaway":
        try:
            note(stop_throwaway())
        except Unavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        url = SERVICES[args.service](args.port or DEFAULT_PORTS[args.service])
    except Unavailable as exc:
        level = "error" if args.require else "warning"
        print(f"{level}: {NAMES[args.service]} is not available: {exc}", file=sys.stderr)
        return 1 if args.require else 3
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
