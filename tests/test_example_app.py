"""The example app against a real database: an embedded worker on an in-memory broker, and the
demo end to end in real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import kombu
import pytest
import redis
import sqlalchemy as sa
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from click.testing import CliRunner
from sqlalchemy.engine import Engine

from celery_fence import ConfigurationError, Dispatch, HistoryEntry, Lease, LeaseStore, StaleRun
from celery_fence.contrib.celery import HEADER, REJECTED, Fence, FenceHeader
from celery_fence.store import engine_from_url
from example_app import data, report
from example_app.__main__ import cli
from example_app.celery_app import (
    DEFAULT_BROKER_URL,
    FENCE_VARIABLES,
    app,
    config_from_env,
    parse_value,
)
from example_app.demo import commit_of, expire_lease
from example_app.tasks import OlderBuildError, plan_retention, release

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 30.0


def poll(probe: Callable[[], T | None], timeout: float = TIMEOUT) -> T:
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


@pytest.fixture
def example(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fence]:
    """The example app on this test's database and an in-memory broker. A new Fence reads
    this configuration (the app's own was built for the environment it was imported in), and
    the app's fenced tasks run under it."""
    settings = {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "broker_transport_options": {"polling_interval": 0.01},
        "fence_database_url": database_url,
        "fence_default_ttl": 2.0,
        "example_migrate_seconds": 0.05,
    }
    for key, value in settings.items():
        monkeypatch.setitem(app.conf, key, value)
    fence = Fence(app)
    for task in (plan_retention, release):
        monkeypatch.setattr(task, "fence", fence)
    data.seed(fence.store.engine)
    yield fence
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(app.conf.task_default_queue)
    fence.store.engine.dispose()
    fence.keeper_store.engine.dispose()


@pytest.fixture
def worker(example: Fence) -> Iterator[None]:
    with start_worker(
        app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=20
    ):
        yield


@pytest.fixture
def store(example: Fence) -> LeaseStore:
    return example.store


def send_release(environment: str, build: int, **options: Any) -> AsyncResult:
    return release.apply_async(
        kwargs={
            "environment": environment,
            "release_id": f"r-{build}",
            "commit": commit_of(build),
            "build": build,
            **options,
        }
    )


def manifest_of(store: LeaseStore, environment: str) -> data.Manifest:
    (manifest,) = [m for m in data.manifests(store.engine) if m.environment == environment]
    return manifest


def outcomes(store: LeaseStore) -> list[tuple[str, int, str]]:
    return [(r.release_id, r.epoch, r.outcome) for r in data.releases(store.engine)]


# -- configuration ---------------------------------------------------------------------------


def test_config_reads_each_fence_key_from_its_variable() -> None:
    conf = config_from_env(
        {"CELERY_FENCE_BEAT_TTL": "3", "CELERY_FENCE_ENFORCEMENT": '{"*": "shadow"}'}
    )
    assert conf["fence_beat_ttl"] == 3
    assert conf["fence_enforcement"] == {"*": "shadow"}
    assert FENCE_VARIABLES["CELERY_FENCE_DATABASE_URL"] == "fence_database_url"
    assert config_from_env({})["broker_url"] == DEFAULT_BROKER_URL
    assert "fence_beat_ttl" not in config_from_env({})


def test_config_keeps_text_as_text() -> None:
    assert parse_value("postgresql://u@h/db") == "postgresql://u@h/db"
    assert parse_value("true") == "true"
    assert parse_value("2.5") == 2.5


def test_filesystem_broker_needs_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CELERY_FENCE_BROKER_FOLDER"):
        config_from_env({"CELERY_FENCE_BROKER_URL": "filesystem://"})
    conf = config_from_env(
        {"CELERY_FENCE_BROKER_URL": "filesystem://", "CELERY_FENCE_BROKER_FOLDER": str(tmp_path)}
    )
    options = conf["broker_transport_options"]
    assert options["data_folder_in"] == options["data_folder_out"] == str(tmp_path / "messages")
    assert conf["broker_transport"] == "example_app.broker:Transport"


def test_a_filesystem_message_appears_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each message is written in full under a name consumers ignore, then renamed into place
    (atomic within a folder), so a consumer never finds a message file still being written; and
    a consumer gets every message (kombu orders messages of the same millisecond at random)."""
    folder = tmp_path / "messages"
    folder.mkdir()
    renamed: list[str] = []
    rename = os.replace

    def replace(source: str, destination: str) -> None:
        assert Path(source).name.startswith(".")  # kombu's consumers pass it by
        assert not Path(destination).exists()
        renamed.append(json.loads(Path(source).read_bytes())["body"])
        rename(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    options = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(tmp_path / "control"),
    }
    with kombu.Connection(
        "filesystem://", transport="example_app.broker:Transport", transport_options=options
    ) as connection:
        queue = connection.SimpleQueue("whole")
        for number in range(20):
            queue.put(number)
        assert [path.name for path in folder.iterdir() if path.name.startswith(".")] == []
        received = []
        for _ in range(20):
            message = queue.get(timeout=5)
            message.ack()
            received.append(message.payload)
    assert len(renamed) == 20
    assert sorted(received) == list(range(20))


# -- seed and retention planning -------------------------------------------------------------


@pytest.fixture
def app_engine(database_url: str) -> Iterator[Engine]:
    engine = engine_from_url(database_url)
    yield engine
    engine.dispose()


def test_seed_creates_documents_once(app_engine: Engine) -> None:
    assert data.seed(app_engine) == data.SEED_DOCUMENTS
    assert data.seed(app_engine) == data.SEED_DOCUMENTS
    with app_engine.connect() as conn:
        due = conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE retention_until <= now()), count(*) "
                "FROM example_app.documents"
            )
        ).one()
    assert tuple(due) == (data.SEED_DOCUMENTS // 2 + 1, data.SEED_DOCUMENTS)


def test_seed_command(example: Fence) -> None:
    result = CliRunner().invoke(cli, ["seed"])
    assert result.exit_code == 0, result.output
    assert f"{data.SEED_DOCUMENTS} documents" in result.output


def due_ids(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id FROM example_app.documents "
                    "WHERE retention_until <= now() ORDER BY id"
                )
            ).scalars()
        )


def test_plan_retention_writes_a_plan_under_its_lease_and_deletes_nothing(
    store: LeaseStore, worker: None
) -> None:
    result = plan_retention.delay().get(timeout=TIMEOUT)

    (plan,) = data.plans(store.engine)
    (won,) = store.history("retention:planner")
    assert (plan.lease_name, plan.epoch, plan.holder) == (won.name, won.epoch, won.holder)
    assert (plan.scheduled_by, plan.schedule_epoch) == (None, None)
    assert plan.document_ids == due_ids(store.engine) == result["document_ids"]
    assert len(plan.document_ids) == data.SEED_DOCUMENTS // 2 + 1
    with store.engine.connect() as conn:
        assert data.document_count(conn) == data.SEED_DOCUMENTS


def scheduler_epoch(store: LeaseStore, holder: str) -> tuple[Lease, dict[str, Any]]:
    """Lead the schedule as a fenced beat would; return the lease and the header it sends."""
    lease = store.acquire("scheduler:example_app", holder=holder, ttl=30).lease
    assert lease is not None
    return lease, {HEADER: FenceHeader.for_lease(lease, "join").to_message()}


def test_plan_retention_from_beat_records_the_scheduler_epoch_under_its_own_lease(
    store: LeaseStore, worker: None
) -> None:
    _, header = scheduler_epoch(store, "beat@a")

    plan_retention.apply_async(headers=header).get(timeout=TIMEOUT)

    (plan,) = data.plans(store.engine)
    (won,) = store.history("retention:planner")
    assert (plan.lease_name, plan.epoch, plan.holder) == (won.name, won.epoch, won.holder)
    assert (plan.scheduled_by, plan.schedule_epoch) == ("scheduler:example_app", 1)


def test_plan_retention_under_a_superseded_scheduler_epoch_is_rejected(
    store: LeaseStore, worker: None
) -> None:
    stale, header = scheduler_epoch(store, "beat@a")
    store.release(stale)
    scheduler_epoch(store, "beat@b")

    result = plan_retention.apply_async(headers=header)

    assert poll(lambda: result.state == REJECTED)
    assert data.plans(store.engine) == []
    (record,) = store.stale_runs(lease_name="scheduler:example_app")
    assert (record.stale_epoch, record.reason, record.current_epoch) == (1, "superseded", 2)


# -- releases --------------------------------------------------------------------------------


def test_release_publishes_a_manifest_with_its_release_and_epoch(
    store: LeaseStore, worker: None
) -> None:
    result = send_release("production", 7)
    published = result.get(timeout=TIMEOUT)

    manifest = manifest_of(store, "production")
    (won,) = store.history("release:production")
    assert (manifest.release_id, manifest.build, manifest.commit) == ("r-7", 7, commit_of(7))
    assert manifest.epoch == won.epoch == published["epoch"]
    assert won.purpose == "release r-7 build 7"
    assert result.id in won.holder
    assert outcomes(store) == [("r-7", won.epoch, "published")]


def test_the_newer_build_stays_current_whatever_the_order(store: LeaseStore, worker: None) -> None:
    orders = {"production": (41, 42), "staging": (42, 41)}
    for environment, builds in orders.items():
        for build in builds:
            send_release(environment, build).get(timeout=TIMEOUT, propagate=False)

    for environment in orders:
        assert manifest_of(store, environment).release_id == "r-42"
    assert [(r.environment, r.release_id, r.outcome) for r in data.releases(store.engine)] == [
        ("production", "r-41", "published"),
        ("production", "r-42", "published"),
        ("staging", "r-42", "published"),
        ("staging", "r-41", "refused"),
    ]


def test_racing_releases_newer_build_wins(store: LeaseStore, worker: None) -> None:
    racers = [send_release("production", build, migrate_seconds=1.0) for build in (41, 42)]
    for racer in racers:
        racer.get(timeout=TIMEOUT, propagate=False)

    assert store.metrics.get("busy.retry") >= 1, "the two releases did not overlap"
    manifest = manifest_of(store, "production")
    assert (manifest.release_id, manifest.build) == ("r-42", 42)
    epochs = [h.epoch for h in store.history("release:production")]
    assert sorted(epochs) == [1, 2]
    assert ("r-42", manifest.epoch, "published") in outcomes(store)


def test_an_older_build_is_refused_unless_it_is_a_rollback(store: LeaseStore, worker: None) -> None:
    send_release("production", 42).get(timeout=TIMEOUT)

    with pytest.raises(OlderBuildError, match="build 41 is older"):
        send_release("production", 41).get(timeout=TIMEOUT)
    assert manifest_of(store, "production").build == 42

    send_release("production", 41, rollback=True).get(timeout=TIMEOUT)
    manifest = manifest_of(store, "production")
    assert (manifest.build, manifest.rollback, manifest.epoch) == (41, True, 3)
    assert [o for _, _, o in outcomes(store)] == ["published", "refused", "published"]


def test_a_release_in_shadow_mode_is_refused_before_it_publishes(
    example: Fence, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shadow mode lets a stale write commit, which this app's releases must never do."""
    monkeypatch.setitem(app.conf, "fence_enforcement", {"*": "shadow"})
    shadow = Fence(app, store=example.store)
    monkeypatch.setattr(release, "fence", shadow)
    result = release.apply(
        kwargs={
            "environment": "production",
            "release_id": "r-1",
            "commit": commit_of(1),
            "build": 1,
        }
    )
    with pytest.raises(ConfigurationError, match="fence_enforcement=enforce only"):
        result.get(timeout=TIMEOUT)
    assert data.manifests(example.store.engine) == []


def test_an_invalid_release_writes_nothing(store: LeaseStore, worker: None) -> None:
    result = release.delay("production", "r-1", "not-a-commit", 1)
    with pytest.raises(ValueError, match="commit"):
        result.get(timeout=TIMEOUT)
    assert data.manifests(store.engine) == []


def test_an_expired_release_holders_publish_is_rejected_and_recorded(
    store: LeaseStore, worker: None
) -> None:
    expired = send_release("staging", 8, migrate_seconds=1.5)
    poll(lambda: (o := store.owner("release:staging")) is not None and expired.id in o.holder)
    assert expire_lease(store.engine, "release:staging") == 1

    rerun = send_release("staging", 8)
    assert rerun.get(timeout=TIMEOUT)["epoch"] == 2
    expired.get(timeout=TIMEOUT, propagate=False)

    assert expired.state == "FAILURE"
    manifest = manifest_of(store, "staging")
    assert (manifest.release_id, manifest.epoch) == ("r-8", 2)
    assert sorted(outcomes(store)) == [("r-8", 1, "rejected"), ("r-8", 2, "published")]
    (publish,) = [
        s for s in store.stale_runs(environment="staging") if s.action == "publish r-8 build 8"
    ]
    assert (publish.stale_epoch, publish.current_epoch) == (1, 2)
    assert publish.reason in ("superseded", "expired")
    assert expired.id in publish.stale_holder


# -- the command line ------------------------------------------------------------------------


def test_release_command_sends_a_release_and_status_shows_it(
    store: LeaseStore, worker: None
) -> None:
    sent = CliRunner().invoke(cli, ["release", "production", "r-5", commit_of(5), "5"])

    assert sent.exit_code == 0, sent.output
    assert "sent release r-5 (build 5) to production" in sent.output
    poll(lambda: data.releases(store.engine))
    status = CliRunner().invoke(cli, ["status"])
    assert status.exit_code == 0, status.output
    assert "release:production (environment production)" in status.output
    assert f"production  r-5    build 5    commit {commit_of(5)} epoch 1" in status.output


def test_release_command_refuses_invalid_arguments(example: Fence) -> None:
    result = CliRunner().invoke(cli, ["release", "production", "r-5", "xyz", "5"])
    assert result.exit_code == 2
    assert "commit must be 7 to 40 lowercase hex digits" in result.output


def test_release_command_says_which_broker_it_could_not_reach() -> None:
    # A process of its own: the app reads its broker from the environment when imported.
    done = subprocess.run(
        [sys.executable, "-m", "example_app", "release", "production", "r-5", commit_of(5), "5"],
        cwd=REPO_ROOT,
        env={**os.environ, "CELERY_FENCE_BROKER_URL": "redis://:secret@127.0.0.1:1/13"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith(
        "Error: cannot send the release to the broker at redis://:**@127.0.0.1:1/13: "
    ), done.stderr
    assert "Traceback" not in done.stderr


def test_status_of_an_empty_database_says_none_under_every_heading(example: Fence) -> None:
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Who won each epoch\n  (none)\n")


# -- the report's invariant checks -----------------------------------------------------------

SCHEDULE = "scheduler:example_app"
PLANNER = "retention:planner"
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def won(
    epoch: int, holder: str, start: float, end: float | None, name: str = SCHEDULE
) -> HistoryEntry:
    return HistoryEntry(
        name=name,
        epoch=epoch,
        environment="default",
        holder=holder,
        purpose="",
        acquired_at=at(start),
        ended_at=None if end is None else at(end),
        end_reason=None if end is None else "expired",
    )


def dispatched(epoch: int, holder: str, second: float) -> Dispatch:
    return Dispatch(
        schedule=SCHEDULE,
        entry="plan-retention",
        slot=at(second),
        task="example_app.tasks.plan_retention",
        epoch=epoch,
        holder=holder,
        dispatched_at=at(second),
    )


def planned(schedule_epoch: int, number: int) -> data.Plan:
    """The plan of the ``number``-th run, sent by the scheduler at ``schedule_epoch``; the run
    held the planner lease at epoch ``number``."""
    return data.Plan(
        id=number,
        lease_name=PLANNER,
        epoch=number,
        holder=f"plan[t{number}]",
        task_id=f"t{number}",
        planned_at=at(number),
        document_ids=[1],
        scheduled_by=SCHEDULE,
        schedule_epoch=schedule_epoch,
    )


def planner_history(runs: int) -> list[HistoryEntry]:
    return [won(n, f"plan[t{n}]", n, n + 0.5, name=PLANNER) for n in range(1, runs + 1)]


def released(environment: str, build: int, epoch: int, outcome: str) -> data.ReleaseRecord:
    return data.ReleaseRecord(
        environment=environment,
        release_id=f"r-{build}",
        commit=commit_of(build),
        build=build,
        rollback=False,
        task_id=f"r-{build}-{epoch}",
        epoch=epoch,
        holder=f"release[r-{build}-{epoch}]",
        outcome=outcome,
        detail="",
        logged_at=at(epoch),
    )


@pytest.fixture
def beat_snapshot() -> report.Snapshot:
    """Epoch 1 (beat a) expired at 10 s; epoch 2 (beat b) holds; one plan per slot."""
    return report.Snapshot(
        leases=[],
        history={
            SCHEDULE: [won(1, "a", 0, 10), won(2, "b", 10, None)],
            PLANNER: planner_history(4),
        },
        dispatches=[dispatched(1, "a", 2), dispatched(1, "a", 4), dispatched(2, "b", 12)],
        stale_runs=[],
        manifests=[],
        releases=[],
        plans=[planned(1, 1), planned(1, 2), planned(2, 3)],
        documents=12,
    )


def test_slot_check_holds_for_slots_dispatched_by_their_epoch(
    beat_snapshot: report.Snapshot,
) -> None:
    assert report.slots_dispatched_once(beat_snapshot).ok
    assert report.one_plan_per_slot(beat_snapshot).ok
    assert report.failover(beat_snapshot, SCHEDULE, 1).ok


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (dispatched(1, "a", 14), "dispatched after epoch 1 ended"),
        (dispatched(2, "a", 16), "dispatched by a, not epoch 2's"),
        (dispatched(2, "b", 12), "dispatched 2 times"),
    ],
)
def test_slot_check_catches_a_bad_dispatch(
    beat_snapshot: report.Snapshot, extra: Dispatch, problem: str
) -> None:
    check = report.slots_dispatched_once(
        replace(beat_snapshot, dispatches=[*beat_snapshot.dispatches, extra])
    )
    assert not check.ok
    assert problem in check.text


def test_plan_check_catches_a_slot_planned_twice(beat_snapshot: report.Snapshot) -> None:
    twice = replace(beat_snapshot, plans=[*beat_snapshot.plans, planned(2, 4)])
    check = report.one_plan_per_slot(twice)
    assert not check.ok
    assert "2 plans for 1 slot sent by scheduler:example_app epoch 2" in check.text
    assert not report.one_plan_per_slot(replace(beat_snapshot, plans=[])).ok


def test_plan_check_catches_a_plan_not_written_by_its_epochs_holder(
    beat_snapshot: report.Snapshot,
) -> None:
    intruder = replace(planned(2, 3), holder="plan[t9]")
    check = report.one_plan_per_slot(
        replace(beat_snapshot, plans=[*beat_snapshot.plans[:2], intruder])
    )
    assert not check.ok
    assert "plan 3 written by plan[t9], not by retention:planner epoch 3's holder" in check.text


def test_plan_check_catches_a_plan_written_after_its_epoch_ended(
    beat_snapshot: report.Snapshot,
) -> None:
    late = replace(planned(2, 3), planned_at=at(3.75))
    check = report.one_plan_per_slot(replace(beat_snapshot, plans=[*beat_snapshot.plans[:2], late]))
    assert not check.ok
    assert "plan 3 written at " in check.text
    assert "while retention:planner epoch 3 did not hold" in check.text


def test_failover_check_needs_another_holder(beat_snapshot: report.Snapshot) -> None:
    same = {SCHEDULE: [won(1, "a", 0, 10), won(2, "a", 10, None)]}
    assert not report.failover(replace(beat_snapshot, history=same), SCHEDULE, 1).ok


def test_manifest_check_wants_the_winners_epoch(beat_snapshot: report.Snapshot) -> None:
    winner = released("staging", 8, 2, "published")
    manifest = data.Manifest(
        environment="staging",
        release_id="r-8",
        commit=commit_of(8),
        build=8,
        epoch=2,
        rollback=False,
        published_at=at(2),
    )
    history = {**beat_snapshot.history, "release:staging": [won(2, winner.holder, 1, 3)]}
    state = replace(beat_snapshot, releases=[winner], manifests=[manifest], history=history)
    assert report.current_manifest(state, "staging", winner.task_id).ok
    late = replace(state, manifests=[replace(manifest, published_at=at(4))])
    assert not report.current_manifest(late, "staging", winner.task_id).ok
    stale = replace(state, manifests=[replace(manifest, epoch=1)])
    assert not report.current_manifest(stale, "staging", winner.task_id).ok
    assert not report.publish_rejected(stale, winner.task_id).ok


def test_rejection_check_wants_a_stale_run_per_rejected_publish(
    beat_snapshot: report.Snapshot,
) -> None:
    rejected = released("staging", 8, 1, "rejected")
    state = replace(beat_snapshot, releases=[rejected])
    check = report.rejections_recorded(state)
    assert not check.ok
    assert "release:staging epoch 1 'publish r-8 build 8'" in check.text
    record = StaleRun(
        id=1,
        recorded_at=at(3),
        environment="staging",
        lease_name="release:staging",
        stale_epoch=1,
        stale_holder=rejected.holder,
        current_epoch=2,
        current_holder="x",
        reason="superseded",
        action="publish r-8 build 8",
        enforced=True,
    )
    assert report.rejections_recorded(replace(state, stale_runs=[record])).ok
    assert not report.rejections_recorded(replace(state, stale_runs=[record]), [(SCHEDULE, 1)]).ok


# -- the demo, end to end --------------------------------------------------------------------

INVARIANTS = (
    "[ok] each schedule slot dispatched at most once",
    "[ok] at most one retention plan per dispatched slot",
    "[ok] planning deleted nothing",
    "[ok] beat failover",
    "[ok] production: one current manifest, the winning release's (r-42 build 42",
    "[ok] staging: one current manifest, the winning release's (r-8 build 8 epoch 2",
    "[ok] the expired holder's publish was rejected",
    "[ok] every rejected stale run is recorded",
)


@pytest.fixture
def shared(request: pytest.FixtureRequest) -> ModuleType:
    """tests/conftest.py, for ``missing_service`` and ``server_url``."""
    module = request.config.pluginmanager.get_plugin(str(REPO_ROOT / "tests" / "conftest.py"))
    assert isinstance(module, ModuleType)
    return module


def demo_command(broker: str, shared: ModuleType) -> tuple[list[str], dict[str, str]]:
    """The commands docs/how-to/run-the-demo.md shows, and their environment: ``scripts/demo``
    on the machine's Redis, and with the filesystem broker."""
    if broker == "filesystem":
        return ["scripts/demo", "--broker", "filesystem://"], {}
    url = os.environ.get("CELERY_FENCE_BROKER_URL", DEFAULT_BROKER_URL)
    try:
        redis.Redis.from_url(url, socket_timeout=3).ping()
    except redis.RedisError as exc:
        shared.missing_service(f"Redis at {url}", exc)
    return ["scripts/demo"], {"CELERY_FENCE_BROKER_URL": url}


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("broker", ["redis", "filesystem"])
def test_demo_runs_end_to_end_and_every_invariant_holds(
    admin_engine: Engine, shared: ModuleType, broker: str
) -> None:
    command, variables = demo_command(broker, shared)
    database = (
        shared.server_url().set(drivername="postgresql").render_as_string(hide_password=False)
    )
    started = time.monotonic()
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, **variables, "CELERY_FENCE_DATABASE_URL": database},
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.monotonic() - started

    assert done.returncode == 0, done.stdout + done.stderr
    for line in INVARIANTS:
        assert line in done.stdout, done.stdout
    assert "FAILED" not in done.stdout
    assert f"{len(INVARIANTS)} of {len(INVARIANTS)} invariants held" in done.stdout
    assert elapsed < 90, f"the demo took {elapsed:.0f} s"
