"""The demo: the example app end to end, in real processes, ending with a report.

    python -m example_app demo [--broker URL] [--logs DIR]

PostgreSQL comes from ``CELERY_FENCE_DATABASE_URL``, else 127.0.0.1:5432, else a throwaway
cluster started from the installed server binaries (``scripts/services.py``) and removed at the
end; the run gets a scratch database of its own, dropped at the end. The broker is ``--broker``
or ``CELERY_FENCE_BROKER_URL``, else the machine's Redis when it answers, else kombu's
``filesystem://`` transport in a temporary folder.

Two workers (prefork, concurrency 2) and two fenced beat instances (``-S fence``, a 3 s TTL)
run three scenes:

1. the beat leader is paused (SIGSTOP) past its TTL, a standby takes over, and the old leader
   is resumed (SIGCONT): it must step down without dispatching again;
2. two releases of different builds for one environment are sent at once: the newer build must
   end up current;
3. a release's lease expires while it is still migrating (its row is aged in SQL, as if its
   renewals had stopped arriving) and the release is run again: the re-run publishes, and the
   first run's publish must be rejected by the fence and recorded.

The report says who won each epoch, each environment's manifest, every rejected stale run and
the dispatched slots, then checks the invariants; the exit status is 1 if any failed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from celery_fence import LeaseStore, Owner
from celery_fence.store import engine_from_url
from example_app import data, report
from example_app.celery_app import app, config_from_env
from example_app.tasks import release

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEDULE = "scheduler:example_app"
BEAT_TTL = 3
#: Settings the demo's processes run with: short leases, so that it all fits in a minute.
SETTINGS = {
    "CELERY_FENCE_BEAT_LEASE": SCHEDULE,
    "CELERY_FENCE_BEAT_TTL": str(BEAT_TTL),
    "CELERY_FENCE_DEFAULT_TTL": "4",
    "EXAMPLE_APP_PLAN_EVERY": "2",
    "EXAMPLE_APP_MIGRATE_SECONDS": "0.5",
}
LONG_MIGRATION = 2.5
WORKER_ARGS = ("--pool=prefork", "--concurrency=2", "--without-mingle", "--without-gossip")
TAIL_LINES = 15


class DemoFailed(Exception):
    """Something the demo waits for did not happen; the message says what."""


class Progress:
    """Prints one line per step, with the seconds since the demo started."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.started = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed:5.1f}s] {message}", file=self.out, flush=True)


# -- services --------------------------------------------------------------------------------


def load_services() -> ModuleType:
    """scripts/services.py, which finds or starts PostgreSQL and probes Redis."""
    path = REPO_ROOT / "scripts" / "services.py"
    spec = importlib.util.spec_from_file_location("celery_fence_services", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise DemoFailed(f"{path} is missing: run the demo from a clone of the repository")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def find_postgres(services: ModuleType, stack: ExitStack, say: Progress) -> str:
    """A PostgreSQL server URL; a throwaway cluster started here is removed at the end."""
    before = services.load_state()
    try:
        url: str = services.postgres(services.DEFAULT_PORTS["postgres"])
    except services.Unavailable as exc:
        raise DemoFailed(f"PostgreSQL is not available: {exc}") from exc
    if before is None and services.load_state() is not None:
        say("started a throwaway PostgreSQL cluster; it is removed at the end")
        stack.callback(services.stop_throwaway)
    return url


def scratch_database(server_url: str, stack: ExitStack) -> str:
    """Create a database for this run on the server, dropped at the end; return its URL."""
    name = f"example_app_demo_{os.getpid()}"
    admin = engine_from_url(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)

    def drop() -> None:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    drop()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    stack.callback(admin.dispose)
    stack.callback(drop)
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def choose_broker(requested: str | None, services: ModuleType, workdir: Path) -> dict[str, str]:
    """The broker variables for the demo's processes."""
    url = requested or os.environ.get("CELERY_FENCE_BROKER_URL")
    if not url:
        port = services.DEFAULT_PORTS["redis"]
        answers = services.redis_answers(port)
        url = f"redis://{services.HOST}:{port}/0" if answers else "filesystem://"
    variables = {"CELERY_FENCE_BROKER_URL": url}
    if url.startswith("filesystem://"):
        folder = workdir / "broker"
        (folder / "messages").mkdir(parents=True)
        variables["CELERY_FENCE_BROKER_FOLDER"] = str(folder)
    return variables


def expire_lease(engine: Engine, name: str) -> int:
    """Make the lease expire now, as if its holder's renewals had stopped arriving: its row's
    expiry is set to this moment. Return the epoch that expired."""
    with engine.begin() as conn:
        epoch = conn.execute(
            sa.text(
                """
                UPDATE celery_fence.leases
                SET expires_at = clock_timestamp(),
                    renewed_at = least(renewed_at, clock_timestamp())
                WHERE name = :name AND released_at IS NULL
                RETURNING epoch
                """
            ),
            {"name": name},
        ).scalar_one_or_none()
    if epoch is None:
        raise ValueError(f"lease {name} is not held")
    return int(epoch)


# -- processes -------------------------------------------------------------------------------


class Processes:
    """The workers and beats the demo started, each in a process group of its own."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """``python -m example_app ARGS``, which execs ``celery -A example_app.celery_app``."""
        with (self.logs / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "example_app", *args],
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def name_of(self, pid: int) -> str:
        for name, process in self.started.items():
            if process.pid == pid:
                return name
        raise DemoFailed(f"pid {pid} leads, but it is none of the demo's beat processes")

    def check(self) -> None:
        """Fail when a process the demo started has exited."""
        for name, process in self.started.items():
            if process.poll() is not None:
                raise DemoFailed(f"{name} exited with status {process.returncode}")

    def tails(self) -> list[str]:
        lines = []
        for name in self.started:
            lines.append(f"--- last lines of {name}.log")
            lines += self.log(name).splitlines()[-TAIL_LINES:]
        return lines

    def stop(self, timeout: float = 30.0) -> None:
        """Warm shutdown, newest first (beats, then workers); whatever is left after
        ``timeout`` is killed with its whole process group."""
        running = [p for p in reversed(self.started.values()) if p.poll() is None]
        for process in running:
            os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.started.values():
            with suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the group: prefork children too
            process.wait()
        self.started.clear()


# -- the scenes ------------------------------------------------------------------------------


def commit_of(build: int) -> str:
    return hashlib.sha1(f"build {build}".encode()).hexdigest()[:7]


class Demo:
    def __init__(self, store: LeaseStore, processes: Processes, say: Progress) -> None:
        self.store = store
        self.processes = processes
        self.say = say

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float) -> T:
        """Poll ``probe`` until it answers; fail after ``timeout`` or if a process died."""
        deadline = time.monotonic() + timeout
        while True:
            self.processes.check()
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.1)

    def beat(self, owner: Owner) -> tuple[str, int]:
        """The demo's beat process that ``owner`` names (holders are ``beat@HOST:PID:NONCE``)."""
        pid = int(owner.holder.split(":")[1])
        return self.processes.name_of(pid), pid

    def leader(self, newer_than: int = 0) -> Owner | None:
        owner = self.store.owner(SCHEDULE)
        return owner if owner is not None and owner.held and owner.epoch > newer_than else None

    def start(self) -> None:
        self.say(
            "starting 2 workers (prefork, concurrency 2) and 2 beat instances "
            f"(-S fence, lease TTL {BEAT_TTL} s)"
        )
        for number in (1, 2):
            self.processes.start(
                f"worker{number}", "worker", *WORKER_ARGS, f"--hostname=worker{number}@%h"
            )
        for number in (1, 2):
            self.processes.start(f"beat{number}", "beat")
        self.wait(
            "both workers to be ready",
            lambda: all(" ready." in self.processes.log(f"worker{n}") for n in (1, 2)),
            60,
        )
        leader = self.wait("a beat instance to lead", self.leader, 30)
        name, _ = self.beat(leader)
        self.say(f"workers ready; {name} leads {SCHEDULE} at epoch {leader.epoch}")
        self.wait("two retention plans", lambda: len(data.plans(self.store.engine)) >= 2, 30)
        self.say("the retention planner runs every 2 s; its first plans are written")

    def pause_leader(self) -> tuple[int, bool]:
        """Scene 1; returns the paused leader's epoch, and whether a rejection of it was
        recorded (its renewal's; a leader that finds its own deadline passed records none)."""
        leader = self.wait("a beat instance to lead", self.leader, 30)
        paused, pid = self.beat(leader)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        self.say(f"paused the leader {paused} (SIGSTOP) at epoch {leader.epoch}")
        successor = self.wait(
            "a standby to take over", lambda: self.leader(newer_than=leader.epoch), 30
        )
        taken_over, _ = self.beat(successor)
        self.say(
            f"{taken_over} took over at epoch {successor.epoch}, "
            f"{time.monotonic() - stopped_at:.1f} s after the pause"
        )
        os.kill(pid, signal.SIGCONT)
        self.say(f"resumed {paused} (SIGCONT)")

        def stepped_down() -> tuple[str, bool] | None:
            """How the resumed leader stepped down, and whether that was recorded: most often
            its next renewal is rejected (and recorded); paused in the middle of a tick, it
            finds its own deadline passed at the dispatch it was making, and sends nothing
            (which the database never saw)."""
            for stale in self.store.stale_runs(lease_name=SCHEDULE):
                if (stale.stale_epoch, stale.stale_holder, stale.action) == (
                    leader.epoch,
                    leader.holder,
                    "renew",
                ):
                    return (
                        f"its renewal of epoch {stale.stale_epoch} was rejected ({stale.reason}) "
                        "and recorded",
                        True,
                    )
            marker = f"stepped down from epoch {leader.epoch}: "
            for line in self.processes.log(paused).splitlines():
                if marker in line:
                    return f"epoch {leader.epoch}, {line.split(marker, 1)[1]}, sent nothing", False
            return None

        how, recorded = self.wait(f"{paused} to step down", stepped_down, 15)
        self.say(f"{paused} stepped down: {how}")
        return leader.epoch, recorded

    def send(self, environment: str, release_id: str, build: int, **options: Any) -> str:
        task_id = f"{release_id}-{environment}-{uuid.uuid4().hex[:6]}"
        release.apply_async(
            kwargs={
                "environment": environment,
                "release_id": release_id,
                "commit": commit_of(build),
                "build": build,
                **options,
            },
            task_id=task_id,
        )
        return task_id

    def finished(self, *task_ids: str) -> list[data.ReleaseRecord]:
        def probe() -> list[data.ReleaseRecord] | None:
            records = {r.task_id: r for r in data.releases(self.store.engine)}
            return [records[t] for t in task_ids] if all(t in records for t in task_ids) else None

        return self.wait(f"releases {', '.join(task_ids)} to finish", probe, 45)

    def race(self) -> str:
        """Scene 2; returns the task id of the newer build's release."""
        self.say("production: releases r-41 (build 41) and r-42 (build 42) sent at once")
        older = self.send("production", "r-41", 41)
        newer = self.send("production", "r-42", 42)
        for record in sorted(self.finished(older, newer), key=lambda r: r.epoch):
            self.say(
                f"production: {record.release_id} ran at epoch {record.epoch}: {record.outcome}"
                + (" (older build)" if record.outcome == "refused" else "")
            )
        return newer

    def expire(self) -> tuple[str, str, int]:
        """Scene 3; returns the expired run's task id, the re-run's and the expired epoch."""
        lease = "release:staging"
        self.say(f"staging: release r-8 starts a {LONG_MIGRATION:g} s migration")
        expired = self.send("staging", "r-8", 8, migrate_seconds=LONG_MIGRATION)

        def held_by_first_run() -> Owner | None:
            owner = self.store.owner(lease)
            return owner if owner is not None and owner.held and expired in owner.holder else None

        self.wait("release r-8 to take its lease", held_by_first_run, 30)
        epoch = expire_lease(self.store.engine, lease)
        self.say(
            f"staging: aged {lease} epoch {epoch} in SQL: expired while r-8 still migrates; "
            "running r-8 again"
        )
        rerun = self.send("staging", "r-8", 8)
        first, second = self.finished(expired, rerun)
        self.say(
            f"staging: the re-run {second.outcome} at epoch {second.epoch}; the expired run's "
            f"publish at epoch {first.epoch}: {first.outcome}"
        )
        return expired, rerun, epoch


# -- the whole run ---------------------------------------------------------------------------


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run(broker: str | None = None, logs: Path | None = None, out: TextIO = sys.stdout) -> int:
    """Run the demo; return 0 when every invariant held, 1 otherwise."""
    say = Progress(out)
    signal.signal(signal.SIGTERM, _terminate)  # clean up on SIGTERM as on Ctrl-C
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="example-app-")))
        logs = logs or workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        services = load_services()
        server = find_postgres(services, stack, say)
        database_url = scratch_database(server, stack)
        store = LeaseStore.from_url(database_url)
        stack.callback(store.engine.dispose)
        version = store.install()
        seeded = data.seed(store.engine)
        say(
            f"PostgreSQL {make_url(server).render_as_string()}: scratch database "
            f"{make_url(database_url).database}, celery-fence schema version {version}, "
            f"{seeded} documents seeded"
        )
        queue = f"example_app_demo_{os.getpid()}"
        env = {
            **os.environ,
            **SETTINGS,
            **choose_broker(broker, services, workdir),
            "CELERY_FENCE_DATABASE_URL": database_url,
            "EXAMPLE_APP_QUEUE": queue,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            ),
            "PYTHONUNBUFFERED": "1",
        }
        app.conf.update(config_from_env(env))
        stack.callback(app.close)
        stack.callback(_delete_queue, queue)
        say(f"broker {make_url(env['CELERY_FENCE_BROKER_URL']).render_as_string()}, queue {queue}")
        processes = Processes(env, logs)
        stack.callback(processes.stop)
        demo = Demo(store, processes, say)
        checks: list[report.Check] = []
        try:
            demo.start()
            paused_epoch, paused_recorded = demo.pause_leader()
            winner = demo.race()
            expired, rerun, expired_epoch = demo.expire()
        except DemoFailed as exc:
            checks.append(report.Check(False, f"the demo ran to the end: {exc}"))
            for line in processes.tails():
                print(line, file=out)
        say("stopping the workers and beats")
        processes.stop()
        snapshot = report.take_snapshot(store)
        if not checks:
            checks = [
                report.slots_dispatched_once(snapshot),
                report.one_plan_per_slot(snapshot),
                report.nothing_deleted(snapshot, seeded),
                report.failover(snapshot, SCHEDULE, paused_epoch),
                report.current_manifest(snapshot, "production", winner),
                report.current_manifest(snapshot, "staging", rerun),
                report.publish_rejected(snapshot, expired),
                report.rejections_recorded(
                    snapshot,
                    lost=[
                        *([(SCHEDULE, paused_epoch)] if paused_recorded else []),
                        ("release:staging", expired_epoch),
                    ],
                ),
            ]
        print("", *report.render(snapshot), "Invariants", sep="\n", file=out)
        print(*(check.line() for check in checks), sep="\n", file=out)
        failed = sum(not check.ok for check in checks)
        say(
            f"demo finished: {len(checks) - failed} of {len(checks)} invariants held"
            + ("" if not failed else f", {failed} FAILED")
        )
    return 1 if failed else 0


def _delete_queue(name: str) -> None:
    """Drop the run's queue, its bindings and whatever is left in it (beat sends until it
    stops). Declaring it first tells this connection which bindings to remove."""
    with app.connection_for_write() as conn:
        queue = app.amqp.queues[name](conn.default_channel)
        queue.declare()
        queue.delete()
