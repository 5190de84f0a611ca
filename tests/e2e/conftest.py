"""Fixtures for the end-to-end tests: real ``celery worker`` and ``celery beat`` processes.

Each test gets its own database (``database_url``), its own queues on the broker and a log file
per process under ``tmp_path``. The processes run :mod:`tests.e2e.fence_app` from the repository
root in a session of their own, and are always stopped at teardown: SIGCONT (in case a test left
them stopped), SIGTERM, then SIGKILL for the whole process group after a timeout. Their logs are
printed at teardown, which pytest shows when a test fails.

The broker is Redis (``CELERY_FENCE_BROKER_URL``) unless a test parametrizes ``broker`` with
``rabbitmq`` (``CELERY_FENCE_RABBITMQ_URL``); results always go to Redis.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
from celery import Celery
from celery.result import AsyncResult
from kombu import Exchange, Queue
from sqlalchemy.engine import Engine

from celery_fence.contrib.celery import REJECTED, SKIPPED

from . import fence_app

REPO_ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("CELERY_FENCE_BROKER_URL") or "redis://127.0.0.1:6379/0"
RABBITMQ_URL = os.environ.get("CELERY_FENCE_RABBITMQ_URL") or "amqp://guest:guest@127.0.0.1:5672//"
BROKERS = {"redis": REDIS_URL, "rabbitmq": RABBITMQ_URL}
DEFAULT_PORTS = {"redis": 6379, "amqp": 5672, "pyamqp": 5672}
FINISHED = frozenset({"SUCCESS", "FAILURE", "REVOKED", SKIPPED, REJECTED})
STOP_TIMEOUT = 10.0
READY_TIMEOUT = 30.0

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None], *, timeout: float, what: str, every: float = 0.1
) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def missing_service(config: pytest.Config, what: str, error: BaseException | str) -> None:
    """tests/conftest.py's ``missing_service`` (skip locally, fail under CI=true).

    Directories without ``__init__.py`` share the module name ``conftest``, so the root one is
    found among the registered plugins by its file rather than imported by name.
    """
    root = REPO_ROOT / "tests" / "conftest.py"
    for plugin in config.pluginmanager.get_plugins():
        if Path(getattr(plugin, "__file__", None) or "/") == root:
            plugin.missing_service(what, error)
            return
    raise RuntimeError(f"{root} is not loaded")


def require_service(config: pytest.Config, url: str) -> None:
    """Check that the broker at ``url`` accepts connections."""
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[parts.scheme])
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError as exc:
        missing_service(config, f"{parts.scheme} at {address[0]}:{address[1]}", exc)


@dataclass
class Process:
    """One worker or beat process, started in a session (process group) of its own."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    terminated: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self, *texts: str) -> list[str]:
        """The log lines that contain every one of ``texts``."""
        return [line for line in self.output().splitlines() if all(t in line for t in texts)]

    def wait_for_log(self, *texts: str, timeout: float) -> str:
        """Wait for a log line containing every one of ``texts``; return the first such line."""

        def first() -> str | None:
            found = self.lines(*texts)
            if not found and not self.alive:
                raise AssertionError(f"{self.name} exited with {self.popen.returncode}")
            return found[0] if found else None

        return wait_until(first, timeout=timeout, what=f"{texts!r} in the log of {self.name}")

    def terminate(self) -> None:
        """Ask the process to exit: resume its group first (a stopped process cannot act on
        SIGTERM), then SIGTERM, once."""
        if self.alive and not self.terminated:
            self.terminated = True
            self._signal_group(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Terminate, wait up to STOP_TIMEOUT, then SIGKILL whatever is left in the group."""
        self.terminate()
        try:
            self.popen.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            print(f"{self.name} did not stop within {STOP_TIMEOUT:g}s; killing it")
        self._signal_group(signal.SIGKILL)
        self.popen.wait()

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)


@dataclass
class Cluster:
    """Processes, the client app and the queues of one test."""

    env: dict[str, str]
    logs: Path
    client: Celery
    queue: str
    processes: list[Process] = field(default_factory=list)

    def start(self, name: str, *args: str) -> Process:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.e2e.fence_app", *args],
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def worker(self, name: str, *, queue: str | None = None, concurrency: int = 2) -> Process:
        """A prefork worker, returned once it consumes."""
        process = self.start(
            name,
            "worker",
            "--loglevel=INFO",
            "--pool=prefork",
            f"--concurrency={concurrency}",
            f"--queues={queue or self.queue}",
            f"--hostname={name}@%h",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
        )
        process.wait_for_log(" ready.", timeout=READY_TIMEOUT)
        return process

    def beat(self, name: str) -> Process:
        return self.start(name, "beat", "--scheduler=fence", "--loglevel=INFO")

    def send(
        self,
        task: str,
        *args: Any,
        queue: str | None = None,
        headers: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncResult:
        return self.client.send_task(
            task, args=args, kwargs=kwargs, queue=queue or self.queue, headers=headers
        )

    def result(self, task_id: str) -> AsyncResult:
        return self.client.AsyncResult(task_id)

    def finished(self, result: AsyncResult, *, timeout: float = 30.0) -> str:
        """Wait until the task reached a final state (Celery's, or SKIPPED / REJECTED)."""
        return wait_until(
            lambda: result.state if result.state in FINISHED else None,
            timeout=timeout,
            what=f"task {result.id} to finish (state {result.state})",
        )

    def close(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.stop()
        for process in self.processes:
            print(f"----- {process.name} (pid {process.pid}, exit {process.popen.returncode})")
            print(process.output())
        queues = {self.queue, *(f"{self.queue}-{suffix}" for suffix in "ab")}
        with self.client.connection_for_write() as conn:
            for name in queues:  # and the exchange of the same name Celery declares for each
                queue = Queue(name, Exchange(name), routing_key=name).bind(conn.default_channel)
                queue.declare()  # so that the channel knows the bindings the queue takes along
                queue.delete()
                queue.exchange.delete()
        self.client.close()


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> str:
    """The broker URL: Redis, or RabbitMQ when parametrized with ``rabbitmq``."""
    url = BROKERS[getattr(request, "param", "redis")]
    require_service(request.config, url)
    require_service(request.config, REDIS_URL)
    return url


@pytest.fixture
def cluster(broker: str, database_url: str, engine: Engine, tmp_path: Path) -> Iterator[Cluster]:
    """A test's processes on its own database and queue; the app's tables are created."""
    with engine.begin() as conn:
        conn.exec_driver_sql(fence_app.SCHEMA)
    queue = f"e2e-{uuid.uuid4().hex[:12]}"
    env = {
        **os.environ,
        "CELERY_FENCE_DATABASE_URL": database_url,
        "E2E_BROKER_URL": broker,
        "E2E_RESULT_BACKEND": REDIS_URL,
        "E2E_QUEUE": queue,
        "PYTHONUNBUFFERED": "1",
    }
    client = Celery("e2e-client", broker=broker, backend=REDIS_URL, set_as_current=False)
    client.conf.broker_connection_retry_on_startup = True
    cluster = Cluster(env=env, logs=tmp_path, client=client, queue=queue)
    try:
        yield cluster
    finally:
        cluster.close()
