"""Fixtures for the fenced-task tests: Celery's own embedded workers, a database per test.

pytest-celery stays installed. Its pytest plugin (``pytest_celery.plugin``, loaded through its
``pytest11`` entry point) re-exports the fixtures of ``celery.contrib.pytest`` but replaces
``celery_worker`` with a parametrized fixture that starts worker, broker and backend containers
in Docker; being registered after ``-p celery.contrib.pytest``, its ``celery_worker`` is the one
pytest would pick. A conftest's fixtures take precedence over any plugin's, so this file
re-exports Celery's own ``celery_app`` and ``celery_worker``: below ``tests/celery`` they are the
embedded worker in a thread, on the memory transport, configured by ``celery_config`` here.
pytest-celery's Docker parts (``celery_setup`` and its container fixtures) need a Docker engine
answering ``docker info``; no test here uses them.

The ``app`` and ``worker`` fixtures start the same embedded worker (``start_worker``) for an app
of each test's own, on Redis (``CELERY_FENCE_BROKER_URL``) with a queue named for the test: on
the memory transport every worker stop costs four seconds (the blocking loop drains twice with a
fixed two-second timeout), on Redis a tenth of one. Results stay in the in-memory backend. Each
test has its own database (``database_url``). Time is never frozen around a running worker:
leases are expired in SQL (``expire_lease``), or given TTLs of a second or two.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kombu
import pytest
from celery import Celery, signals, states
from celery.contrib.pytest import celery_app as celery_app
from celery.contrib.pytest import celery_worker as celery_worker
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from celery.worker import WorkController

from celery_fence import ConfigurationError
from celery_fence.contrib.celery import REJECTED, SKIPPED, Fence

T = TypeVar("T")
WAIT = 10.0
REDIS_URL = os.environ.get("CELERY_FENCE_BROKER_URL") or "redis://127.0.0.1:6379/0"
ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
#: States after which a fenced task's result no longer changes.
FINISHED = frozenset({*states.READY_STATES, SKIPPED, REJECTED})

StartWorker = Callable[..., AbstractContextManager[WorkController]]


class Wait:
    """Polling with a deadline, instead of sleeps: the worker runs in another thread."""

    @staticmethod
    def until(check: Callable[[], T], *, what: str, timeout: float = WAIT) -> T:
        """Poll ``check`` until it returns something truthy; fail naming ``what`` at the
        deadline."""
        deadline = time.monotonic() + timeout
        while not (value := check()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.02)
        return value

    def finished(self, result: AsyncResult, timeout: float = WAIT) -> str:
        """Wait until the task is done (SKIPPED and REJECTED included); return its state."""
        return str(
            self.until(
                lambda: result.state if result.state in FINISHED else None,
                what=f"task {result.id} to finish",
                timeout=timeout,
            )
        )

    @staticmethod
    def outcome(result: AsyncResult, timeout: float = WAIT) -> Any:
        """The task's return value or exception (polling the backend often, not every 0.5 s)."""
        return result.get(timeout=timeout, interval=0.02, propagate=False)


@pytest.fixture
def wait() -> Wait:
    return Wait()


@pytest.fixture
def failures() -> Iterator[dict[str, BaseException]]:
    """The error of each failed task by task id, as the worker reported it (the result backend
    only keeps its class name and message)."""
    seen: dict[str, BaseException] = {}

    def record(task_id: str, exception: BaseException, **_: Any) -> None:
        seen[task_id] = exception

    signals.task_failure.connect(record, weak=False)
    yield seen
    signals.task_failure.disconnect(record)


@pytest.fixture
def celery_config(database_url: str) -> dict[str, Any]:
    """The configuration of every app here: Celery's ``celery_app`` and the ``app`` fixture."""
    return {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "broker_transport_options": {"polling_interval": 0.01},
        "broker_connection_retry_on_startup": True,
        "task_default_queue": f"celery-fence-{uuid.uuid4().hex}",
        "fence_database_url": database_url,
    }


@pytest.fixture
def celery_worker_parameters() -> dict[str, Any]:
    """Celery's ``celery_worker`` pings with a task these apps do not register: skip that."""
    return {"perform_ping_check": False, "shutdown_timeout": WAIT}


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """The broker of the ``app`` fixture; skipped locally (failed under CI=true) when absent."""
    try:
        with kombu.Connection(REDIS_URL, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        root = request.config.pluginmanager.get_plugin(str(ROOT_CONFTEST))
        root.missing_service(f"Redis at {REDIS_URL}", exc)
    return REDIS_URL


@pytest.fixture
def app(celery_config: dict[str, Any], redis_url: str) -> Iterator[Celery]:
    """A Celery app of the test's own on Redis. Remote control is off: other workers on the
    same Redis must not reach this one with broadcasts."""
    app = Celery("celery-fence-tests", set_as_current=False)
    app.conf.update(celery_config, broker_url=redis_url, worker_enable_remote_control=False)
    yield app
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for queue in list(app.amqp.queues):
            channel.queue_delete(queue)
            # The queue's exchange (of the same name) keeps its bindings in keys of their own,
            # which a delete from a channel that never bound it leaves behind.
            channel.client.delete(
                channel.keyprefix_queue % queue, channel.keyprefix_binding_permanent % queue
            )
    app.close()


def _dispose(fence: Fence) -> None:
    # A test that made the settings invalid never got a store: there is nothing to close.
    with contextlib.suppress(ConfigurationError):
        fence.store.engine.dispose()
        fence.keeper_store.engine.dispose()


@pytest.fixture
def fence(app: Celery) -> Iterator[Fence]:
    fence = Fence(app)
    yield fence
    _dispose(fence)


@pytest.fixture
def worker(app: Celery) -> StartWorker:
    """Start an embedded worker for ``app`` (declare the tasks first): ``with worker(): ...``."""

    @contextmanager
    def run(pool: str = "solo", **options: Any) -> Iterator[WorkController]:
        with start_worker(
            app, pool=pool, perform_ping_check=False, shutdown_timeout=WAIT, **options
        ) as started:
            yield started

    return run


@dataclass(frozen=True)
class Probe:
    """A fenced task ``publish(environment)`` on ``release:{environment}`` whose body only notes
    that it ran: for runs that must be refused before their body."""

    task: Any
    ran: threading.Event


@pytest.fixture
def probe(fence: Fence) -> Callable[..., Probe]:
    """Declare the probe task with these options (declare it before starting the worker)."""

    def declare(**options: Any) -> Probe:
        ran = threading.Event()

        @fence.task(lease="release:{environment}", name="probe.publish", **options)
        def publish(environment: str) -> None:
            ran.set()

        return Probe(publish, ran)

    return declare


@pytest.fixture
def fenced_ping(celery_app: Celery) -> Iterator[Any]:
    """A fenced task on Celery's own ``celery_app``; request it before ``celery_worker``, so
    that the worker's start-up check sees it."""
    fence = Fence(celery_app)

    @fence.task(lease="ping:{name}", ttl=5)
    def ping(name: str) -> tuple[str, int | None]:
        run = fence.current()
        return run.mode, run.epoch

    yield ping
    _dispose(fence)
