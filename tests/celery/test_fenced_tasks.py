"""Fenced tasks on an embedded worker: the decorator, the busy policies, release and enforcement.

Every refused run ends in a state that says so (SKIPPED, RETRY then FAILURE, or FAILURE), never
in a silent SUCCESS, and its body never runs.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from celery import Celery, Task, chain, chord, signals, states
from celery.app.trace import build_tracer
from celery.exceptions import ChordError, Reject, SoftTimeLimitExceeded
from sqlalchemy.engine import Engine

from celery_fence import ConfigurationError, Lease, LeaseHeldError, LeasePausedError, LeaseStore
from celery_fence.contrib.celery import (
    HEADER,
    REJECTED,
    SKIPPED,
    Fence,
    FencedRun,
    FencedTask,
    FenceHeader,
    current_run,
)
from celery_fence.contrib.celery.fence import BUSY_RETRIES
from celery_fence.keeper import LeaseKeeper

if TYPE_CHECKING:
    from conftest import Probe, StartWorker, Wait

HOLDER = "release-job@test"
NAME = "release:prod"


def hold(store: LeaseStore, name: str, *, ttl: float = 60, environment: str = "default") -> int:
    """Take ``name`` from the test, as another holder would; return the epoch."""
    got = store.acquire(name, holder=HOLDER, ttl=ttl, environment=environment)
    assert got.lease is not None, got
    return got.lease.epoch


def test_decorator_keeps_name_signature_and_celery_options(fence: Fence) -> None:
    def publish_release(
        self: Any, environment: str, release_id: int, channel: str = "stable"
    ) -> str:
        """Publish one release."""
        return f"{environment}:{release_id}:{channel}"

    def report(day: str, *, verbose: bool = False) -> str:
        """Write the daily report."""
        return day

    publish = fence.task(
        lease="release:{environment}",
        name="deploy.publish",
        bind=True,
        acks_late=True,
        max_retries=7,
        rate_limit="10/m",
        time_limit=60,
    )(publish_release)
    daily = fence.task(lease="report:{day}")(report)

    assert isinstance(publish, FencedTask)
    assert isinstance(daily, FencedTask)
    assert fence.app.tasks["deploy.publish"] == publish
    assert publish.name == "deploy.publish"
    assert daily.name == f"{__name__}.report"
    # bind=True: the task itself is the first argument, the caller passes the rest.
    bound = inspect.signature(publish_release)
    assert inspect.signature(publish) == bound.replace(
        parameters=list(bound.parameters.values())[1:]
    )
    assert inspect.signature(daily) == inspect.signature(report)
    assert publish.__doc__ == "Publish one release."
    assert daily.__doc__ == "Write the daily report."
    assert (publish.acks_late, publish.max_retries, publish.rate_limit, publish.time_limit) == (
        True,
        7,
        "10/m",
        60,
    )
    assert publish.fence_lease == "release:{environment}"
    assert publish.fence is fence
    assert publish.run("prod", 7) == "prod:7:stable"


class AuditedTask(Task):  # type: ignore[misc]
    """A base class of the app's own, as Celery's ``base=`` option takes."""

    audited: list[str]

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        self.audited.append(task_id)

    # Methods of plain names, which the fence's own (all named fence_...) leave alone.
    def holder(self) -> str:
        return "audit"

    def arguments(self) -> list[str]:
        return self.audited

    def reject(self, reason: str) -> str:
        return f"rejected: {reason}"


def test_a_base_of_celery_is_combined_with_the_fence(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    @fence.task(lease="release:{environment}", base=AuditedTask, audited=[])
    def publish(environment: str) -> list[Any]:
        run = fence.current()
        return [run.mode, run.epoch]

    assert isinstance(publish, FencedTask)
    assert isinstance(publish, AuditedTask)
    with worker():
        result = publish.delay("prod")
        assert wait.outcome(result) == ["owner", 1]

    assert publish.audited == [result.id]
    assert (publish.holder(), publish.arguments(), publish.reject("late")) == (
        "audit",
        [result.id],
        "rejected: late",
    )
    [entry] = store.history(NAME)
    assert entry.end_reason == "released"
    assert entry.holder.startswith(f"{publish.name}[{result.id}]@")
    with pytest.raises(ConfigurationError, match=r"base must be a subclass of celery\.Task"):
        fence.task(lease="release", base=object)


def test_without_base_a_fenced_task_keeps_the_apps_own_task_class(
    celery_config: dict[str, Any], store: LeaseStore
) -> None:
    # As Django's fixup sets task_cls to DjangoTask, for one.
    app = Celery("celery-fence-task-cls", set_as_current=False, task_cls=AuditedTask)
    app.conf.update(celery_config)
    fence = Fence(app, store=store)

    @fence.task(lease="release:{environment}", audited=[])
    def publish(environment: str) -> int | None:
        return fence.current().epoch

    try:
        assert isinstance(publish, FencedTask)
        assert isinstance(publish, AuditedTask)
        result = publish.apply(args=("prod",))
    finally:
        app.close()
    assert result.get() == 1
    assert publish.audited == [result.id]


@pytest.mark.parametrize(
    ("template", "argument", "error"),
    [
        ("orders:{order.id}", {"id": 7}, "AttributeError"),
        ("orders:{order[id]}", [7], "TypeError"),
    ],
)
def test_a_template_that_cannot_be_filled_is_a_configuration_error(
    fence: Fence, store: LeaseStore, template: str, argument: object, error: str
) -> None:
    @fence.task(lease=template, name=f"orders-{error}")
    def ship(order: object) -> str:
        return "shipped"

    result = ship.apply(args=(argument,))
    assert result.state == states.FAILURE
    assert isinstance(result.result, ConfigurationError)
    assert f"cannot fill the lease template {template!r}" in str(result.result)
    assert error in str(result.result)
    assert store.leases() == []


def test_a_run_that_cannot_go_on_after_its_acquisition_gives_the_lease_back(
    fence: Fence, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = threading.Event()

    @fence.task(lease=NAME, ttl=60)
    def publish() -> None:
        ran.set()

    def no_thread(self: Any) -> Any:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr("celery_fence.contrib.celery.fence.LeaseKeeper.start", no_thread)
    result = publish.apply()
    assert result.state == states.FAILURE
    assert "can't start new thread" in str(result.result)
    assert not ran.is_set()
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "released")


@pytest.mark.parametrize("mode", ["owner", "resume"])
def test_a_run_stopped_as_its_renewals_start_stops_them(
    fence: Fence, store: LeaseStore, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A soft time limit can fire at any moment, also just after the keeper started and before
    the body: the run's end still stops the keeper, and gives the lease (or its share) back."""
    started = LeaseKeeper.start
    keepers: list[LeaseKeeper] = []

    def then_stopped(self: LeaseKeeper) -> LeaseKeeper:
        keepers.append(started(self))
        raise SoftTimeLimitExceeded()

    @fence.task(lease=NAME, ttl=60)
    def publish() -> None:
        pass

    parent = None
    headers = None
    if mode == "resume":
        parent = store.acquire(NAME, holder=HOLDER, ttl=60).lease
        assert parent is not None
        headers = {HEADER: FenceHeader.for_lease(parent, "resume").to_message()}
    monkeypatch.setattr("celery_fence.contrib.celery.fence.LeaseKeeper.start", then_stopped)
    result = publish.apply(headers=headers)
    assert (result.state, type(result.result)) == (states.FAILURE, SoftTimeLimitExceeded)
    assert len(keepers) == 1
    assert keepers[0].stopped
    owner = store.owner(NAME)
    assert owner is not None
    if parent is None:
        assert (owner.epoch, owner.state) == (1, "released")
    else:
        # The continuation left its share: its publisher's release is the last.
        assert (owner.epoch, owner.state) == (1, "held")
        assert store.release(parent) == "released"


def test_a_run_whose_release_a_soft_time_limit_stops_ends_as_its_body_did(
    fence: Fence,
    store: LeaseStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The limit fires as the body has returned and the run gives its lease back: the result is
    the body's, the lease is left to expire, and the log says why, with the traceback."""
    caplog.set_level(logging.WARNING, "celery_fence")

    def interrupted(lease: Lease, **options: Any) -> str:
        raise SoftTimeLimitExceeded()

    @fence.task(lease=NAME, ttl=60)
    def publish() -> str:
        monkeypatch.setattr(fence.store, "release", interrupted)
        return "published"

    result = publish.apply()
    assert (result.state, result.result) == (states.SUCCESS, "published")
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "held")
    [said] = [r for r in caplog.records if r.getMessage().startswith("could not release")]
    assert said.getMessage() == (
        f"could not release lease {NAME} (it will expire): SoftTimeLimitExceeded()"
    )
    assert said.exc_info is not None
    assert said.exc_info[0] is SoftTimeLimitExceeded


def test_a_continuation_that_cannot_go_on_after_joining_leaves_the_lease(
    fence: Fence, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = LeaseKeeper.start
    calls: list[LeaseKeeper] = []

    def second_fails(self: LeaseKeeper) -> LeaseKeeper:
        calls.append(self)
        if len(calls) == 2:
            raise RuntimeError("can't start new thread")
        return started(self)

    @fence.task(lease=NAME, ttl=60)
    def child() -> None:
        pass

    @fence.task(lease=NAME, ttl=60)
    def parent() -> str:
        return child.apply().state

    monkeypatch.setattr("celery_fence.contrib.celery.fence.LeaseKeeper.start", second_fails)
    assert parent.apply().get() == states.FAILURE
    # The child left the lease it joined: the parent's release, as its last sharer, ended it.
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "released")


def test_a_continuation_stopped_before_its_body_keeps_its_share_for_its_redelivery(
    app: Celery, fence: Fence, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool process stopped (SystemExit) as a joined continuation starts its renewals, its
    message acknowledged late: the body never ran, so the share is kept for the message's
    redelivery, which joins in its place, instead of being dropped as work done."""
    ran: list[int | None] = []

    @fence.task(lease=NAME, ttl=60, acks_late=True)
    def child() -> None:
        ran.append(fence.current().epoch)

    parent = store.acquire(NAME, holder=HOLDER, ttl=60).lease
    assert parent is not None
    header = {**FenceHeader.for_lease(parent, "resume").to_message(), "publication": "d" * 32}
    task_id = str(uuid.uuid4())
    request = {"id": task_id, "hostname": "w@test", "headers": {HEADER: header}}
    started = LeaseKeeper.start

    def stopped(self: LeaseKeeper) -> LeaseKeeper:
        raise SystemExit(1)

    monkeypatch.setattr("celery_fence.contrib.celery.fence.LeaseKeeper.start", stopped)
    with pytest.raises(SystemExit):
        build_tracer(child.name, child, app=app)(task_id, (), {}, request=request)
    monkeypatch.setattr("celery_fence.contrib.celery.fence.LeaseKeeper.start", started)
    build_tracer(child.name, child, app=app)(task_id, (), {}, request=request)
    assert ran == [parent.epoch]
    assert store.release(parent) == "released"  # the redelivery's share was the one kept


def test_an_impossible_renew_interval_fails_the_run_before_it_takes_the_lease(
    fence: Fence, store: LeaseStore
) -> None:
    @fence.task(lease=NAME, ttl=60, renew_interval=59)
    def publish() -> None:
        pass

    result = publish.apply()
    assert result.state == states.FAILURE
    assert isinstance(result.result, ConfigurationError)
    assert f"{publish.name} renew_interval 59s must be shorter than the 54s" in str(result.result)
    assert f"a 60s lease ({publish.name} ttl less the 10% safety margin)" in str(result.result)
    assert store.leases() == []


def test_min_hold_none_or_zero_means_none(fence: Fence) -> None:
    def body() -> None:
        pass

    for none in (None, 0):
        task = fence.task(lease="release", min_hold=none, name=f"min_hold_{none}")(body)
        assert task.fence_min_hold == 0.0
        assert task.fence_acquisition_ttl(fence.settings) == fence.settings.default_ttl


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"on_busy": "wait"}, "on_busy must be one of skip, retry, raise; got 'wait'"),
        # Zero is not "the default": it is refused, as the settings refuse it.
        ({"ttl": 0}, "ttl must be greater than 0 seconds, got 0"),
        ({"ttl": -1}, "ttl must be greater than 0 seconds, got -1"),
        ({"ttl": 86_401}, "ttl must be at most 86400 seconds"),
        ({"max_hold": 0}, "max_hold must be greater than 0 seconds, got 0"),
        ({"renew_interval": 0}, "renew_interval must be greater than 0 seconds, got 0"),
        ({"renew_interval": "10"}, "renew_interval must be a number of seconds"),
        ({"min_hold": -1}, "min_hold must be 0 or more seconds, got -1"),
        # An empty template would be taken for no environment: fence_environment's.
        ({"environment": ""}, "environment must not be empty"),
        ({"environment": 5}, "environment must be a string"),
    ],
)
def test_decorator_rejects_bad_options_at_declaration(
    fence: Fence, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        fence.task(lease="release", **options)


def test_bound_and_plain_bodies_run_under_their_lease(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    @fence.task(lease="release:{environment}", bind=True)
    def bound(self: Any, environment: str) -> list[Any]:
        run = fence.current()
        assert run.lease is not None
        return [self.request.id, run.mode, run.lease.name, run.epoch, run.lease.holder]

    @fence.task(lease="report:{day}")
    def plain(day: str) -> list[Any]:
        run = fence.current()
        assert run.lease is not None
        return [run.mode, run.lease.name, run.epoch]

    with worker():
        first = bound.delay("prod")
        second = plain.delay("monday")
        bound_seen = wait.outcome(first)
        plain_seen = wait.outcome(second)

    assert bound_seen[:4] == [first.id, "owner", NAME, 1]
    assert bound_seen[4].startswith(f"{bound.name}[{first.id}]@")
    assert plain_seen == ["owner", "report:monday", 1]
    [entry] = store.history(NAME)
    assert (entry.holder, entry.end_reason) == (bound_seen[4], "released")


def test_templates_are_filled_from_args_kwargs_and_defaults(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    @fence.task(
        lease="release:{environment}:{channel}",
        environment="{environment}",
        purpose="publish release {release_id}",
    )
    def publish(environment: str, release_id: int, channel: str = "stable") -> list[Any]:
        lease = fence.current().lease
        assert lease is not None
        return [lease.name, lease.environment, lease.purpose]

    with worker():
        results = [
            publish.delay("prod", 7),
            publish.apply_async(kwargs={"environment": "test", "release_id": 8, "channel": "beta"}),
            publish.apply_async(("dev",), {"release_id": 9}),
        ]
        seen = [wait.outcome(result) for result in results]

    assert seen == [
        ["release:prod:stable", "prod", "publish release 7"],
        ["release:test:beta", "test", "publish release 8"],
        ["release:dev:stable", "dev", "publish release 9"],
    ]
    assert {(o.name, o.environment, o.purpose) for o in store.leases()} == {
        tuple(row) for row in seen
    }


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"lease": "release:{region}"}, "names 'region', which is not a parameter of"),
        ({"environment": "{env}"}, "the environment template '{env}' names 'env'"),
        ({"purpose": "release {build.id}"}, "the purpose template 'release {build.id}' names"),
        (
            {"lease": "release:{0}"},
            "must name the task's parameters ({self_or_environment}, {environment}), not",
        ),
        ({"lease": "release:{}", "bind": True}, "must name the task's parameters ({environment})"),
        ({"lease": "release:{environment"}, "is malformed"),
        ({"lease": "release:{environment!z}"}, "is malformed: unknown conversion !z"),
        ({"lease": "release:{environment:{environment!q}}"}, "unknown conversion !q"),
        ({"lease": "release:{environment.}"}, "is malformed: Empty attribute"),
        ({"lease": "release:{environment[0]x}"}, "is malformed: Only '.' or '['"),
        ({"lease": "release:{environment:>{width}}"}, "names 'width', which is not a parameter"),
        ({"purpose": None}, "the purpose template must be a string, got None"),
        ({"lease": "release:{self}", "bind": True}, "names 'self', which is not a parameter"),
    ],
)
def test_a_template_naming_no_parameter_fails_at_declaration(
    fence: Fence, options: dict[str, Any], error: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(error)):

        @fence.task(**{"lease": "release:{environment}", **options})
        def publish(self_or_environment: Any, environment: str = "prod") -> None:
            pass


def test_keyword_arguments_are_one_parameter_whose_missing_items_fail_the_run(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """``**options`` is filled as the one parameter it is: ``{options[region]}``, not
    ``{region}`` (refused at declaration); a call without that item fails, writing nothing."""
    ran = threading.Event()
    with pytest.raises(ConfigurationError, match="names 'region', which is not a parameter"):

        @fence.task(lease="release:{region}")
        def refused(**options: str) -> None:
            pass

    @fence.task(lease="release:{options[region]}")
    def publish(**options: str) -> None:
        ran.set()

    with pytest.raises(ConfigurationError, match=r"lease template 'release:\{options\[region\]\}'"):
        publish(environment="prod")
    with worker():
        result = publish.delay(environment="prod")
        assert wait.finished(result) == states.FAILURE
        assert wait.finished(publish.delay(region="eu")) == states.SUCCESS

    assert isinstance(result.result, Exception)
    assert "cannot fill the lease template 'release:{options[region]}'" in str(result.result)
    assert "region" in str(result.result)
    assert [lease.name for lease in store.leases()] == ["release:eu"]
    assert store.stale_runs() == []


@pytest.mark.parametrize("taken", ["held", "paused"])
def test_busy_skip_reports_the_owner_and_never_succeeds(
    fence: Fence,
    probe: Callable[..., Probe],
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    taken: str,
) -> None:
    publish = probe(on_busy="skip")

    @fence.task(lease="other")
    def later() -> str:
        return "done"

    epoch = hold(store, NAME)
    said = f"is held by {HOLDER} (epoch {epoch}) until"
    if taken == "paused":
        store.pause(NAME, reason="incident 42", by="ops@test")
        said = f"is paused by ops@test: incident 42; last held by {HOLDER} (epoch {epoch})"
    owner = store.owner(NAME)
    assert owner is not None

    with worker():
        result = publish.task.delay("prod")
        assert wait.finished(result) == SKIPPED
        # The worker runs one task at a time: once the next one is done, the skipped one is
        # over, and its state stayed SKIPPED.
        assert wait.outcome(later.delay()) == "done"

    assert result.state == SKIPPED
    meta = result.info
    assert (meta["lease"], meta["reason"]) == (NAME, taken)
    assert (meta["owner_holder"], meta["owner_epoch"]) == (HOLDER, epoch)
    assert meta["owner_expires_at"] == owner.expires_at.isoformat()
    assert said in meta["message"]
    assert not publish.ran.is_set()
    assert [entry.holder for entry in store.history(NAME)] == [HOLDER]
    assert fence.store.metrics.get("busy.skip") == 1
    # Called directly, the skip raises to its caller: that counts as what it did.
    with pytest.raises(LeaseHeldError if taken == "held" else LeasePausedError):
        publish.task("prod")
    assert (fence.store.metrics.get("busy.skip"), fence.store.metrics.get("busy.raise")) == (1, 1)


@pytest.mark.parametrize("owner_ends", ["released", "expired"])
def test_busy_retry_runs_once_the_owner_is_gone(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, owner_ends: str
) -> None:
    @fence.task(lease="release:{environment}", on_busy="retry", bind=True)
    def publish(self: Any, environment: str) -> list[Any]:
        return [self.request.retries, fence.current().epoch]

    lease = store.acquire(NAME, holder=HOLDER, ttl=1.0).lease
    assert lease is not None
    with worker():
        result = publish.delay("prod")
        wait.until(lambda: result.state == states.RETRY, what="the busy run to be retried")
        if owner_ends == "released":
            store.release(lease)
        # A busy retry is not one of the task's own retries.
        assert wait.outcome(result) == [0, 2]

    assert result.state == states.SUCCESS
    first, _ = store.history(NAME)[::-1]
    assert (first.holder, first.end_reason) == (HOLDER, owner_ends)
    assert fence.store.metrics.get("busy.retry") == 1


def test_a_run_behind_a_lock_on_the_lease_table_is_retried_not_skipped(
    app: Celery, fence: Fence, worker: StartWorker, engine: Engine, store: LeaseStore, wait: Wait
) -> None:
    """Behind a lock on the whole lease table (maintenance) the acquisition cannot tell whether
    anyone holds the lease: a run that would skip a held lease is tried again instead."""
    app.conf.fence_lock_timeout = 0.2

    @fence.task(lease="release:{environment}", on_busy="skip")
    def publish(environment: str) -> int:
        return fence.current().epoch

    with worker():
        with engine.begin() as maintenance:
            maintenance.exec_driver_sql("LOCK TABLE celery_fence.leases IN ACCESS EXCLUSIVE MODE")
            result = publish.delay("prod")
            wait.until(lambda: result.state == states.RETRY, what="the busy run to be retried")
        assert wait.outcome(result) == 1

    assert fence.store.metrics.get("busy.retry") == 1
    assert fence.store.metrics.get("busy.skip") == 0
    assert [entry.epoch for entry in store.history(NAME)] == [1]


def test_busy_retries_are_counted_apart_from_the_task_own_retries(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """A busy retry neither uses up the task's ``max_retries`` nor shows in
    ``request.retries``, and leaves the task's retry limit as it was."""
    runs: list[int] = []

    @fence.task(
        lease="release:{environment}",
        on_busy="retry",
        bind=True,
        autoretry_for=(ValueError,),
        max_retries=1,
        retry_kwargs={"countdown": 0},
    )
    def publish(self: Any, environment: str) -> None:
        runs.append((self.request.retries, (self.request.headers or {}).get(BUSY_RETRIES)))
        raise ValueError("the release is not ready")

    lease = store.acquire(NAME, holder=HOLDER, ttl=1.0).lease
    assert lease is not None
    with worker():
        # Refused once (the busy retry allows fence_busy_max_retries, 10), then run: its own
        # failure is retried by autoretry_for up to the task's max_retries of 1, not 10, and
        # the busy retry did not use that one up.
        busy = publish.delay("prod")
        wait.until(lambda: busy.state == states.RETRY, what="the busy run to be retried")
        store.release(lease)
        assert wait.finished(busy) == states.FAILURE
        # A later run of the task has the same limit.
        again = publish.delay("prod")
        assert wait.finished(again) == states.FAILURE

    # The task's own retry does not carry the busy retries of the run that sent it.
    assert runs == [(0, 1), (1, None), (0, None), (1, None)]
    assert isinstance(busy.result, ValueError)
    assert fence.store.metrics.get("busy.retry") == 1
    # Nothing was left on the task object, which every thread of a threads pool shares.
    assert "override_max_retries" not in vars(publish)


def test_an_eager_or_direct_run_checks_the_tasks_timings_as_a_worker_would(
    fence: Fence, store: LeaseStore
) -> None:
    """Without a worker's start-up check, the error still names the option at fault."""

    @fence.task(lease="release", ttl=10, min_hold=10_000)
    def publish() -> None:
        raise AssertionError("the body of a refused run ran")

    message = rf"^{publish.name} min_hold must be at most 3600 seconds \(the fence_max_ttl"
    with pytest.raises(ConfigurationError, match=message):
        publish()
    with pytest.raises(ConfigurationError, match=message):
        publish.apply().get()
    assert store.owner("release") is None


def test_an_eager_busy_retry_fails_at_once(fence: Fence, store: LeaseStore) -> None:
    """Run eagerly, a retry would run again at once, not at the owner's expiry: the task fails
    with LeaseHeldError, and its own retries are left alone."""

    @fence.task(lease="release:{environment}", on_busy="retry")
    def publish(environment: str) -> None:
        raise AssertionError("the body of a refused run ran")

    hold(store, NAME)
    result = publish.apply(args=("prod",))

    assert result.state == states.FAILURE
    assert isinstance(result.result, LeaseHeldError)
    assert fence.store.metrics.get("busy.raise") == 1
    assert fence.store.metrics.get("busy.retry") == 0


# Each: what became of the earlier delivery while the redelivery waited, the redelivery's end.
EARLIER_DELIVERY = [
    # Its worker was lost: the lease expires, and the redelivery does the work.
    pytest.param("lost", states.SUCCESS, id="lost with its worker"),
    # It still runs (the broker's visibility timeout): it renews the lease, and the redelivery
    # waits again; then it ends, and the redelivery is dropped.
    pytest.param("running", None, id="still running"),
    # It ran to its end and released the lease: the work is done; the redelivery is dropped.
    pytest.param("finished", None, id="finished"),
    # The same, and the lease was paused before the redelivery came back.
    pytest.param("finished, then paused", None, id="finished then paused"),
    # The same, and another message's run took and released the lease in between.
    pytest.param("finished, then another run", None, id="finished then another run"),
    # Its worker was lost, and another delivery of the same message then ran to its end.
    pytest.param("lost, then run elsewhere", None, id="lost then run elsewhere"),
]


def continued_from_a_publisher(
    store: LeaseStore,
    task: FencedTask,
    task_id: str,
    publication: str,
    hostname: str,
    *,
    publisher_ends: bool = True,
    ttl: float = 60,
) -> tuple[dict[str, Any], Lease, Lease]:
    """A publisher's lease continued by a delivery of ``task`` sent with the publisher's header
    and ``publication``, named as the task names that delivery's run on ``hostname``: taken over
    once the publisher released it, or, with ``publisher_ends=False``, joined while the
    publisher holds it. The header, the lease the delivery holds, and the publisher's."""
    publisher = store.acquire(NAME, holder="publisher@test", ttl=ttl).lease
    assert publisher is not None
    if publisher_ends:
        store.release(publisher)
    header = {**FenceHeader.for_lease(publisher, "resume").to_message(), "publication": publication}
    task.push_request(
        id=task_id, called_directly=False, hostname=hostname, headers={HEADER: header}
    )
    try:
        got = store.rejoin(
            NAME,
            epoch=publisher.epoch,
            holder=publisher.holder,
            mode="resume",
            proof=header["proof"],
            ttl=ttl,
            action=f"start {task.name}",
            successor=task.fence_holder(),
            delivery_prefix=task.fence_delivery_prefix(),
        )
    finally:
        task.pop_request()
    assert got.lease is not None
    return header, got.lease, publisher


@pytest.mark.parametrize("continuation", [False, True], ids=["a first run", "a continuation"])
@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize(("earlier", "end"), EARLIER_DELIVERY)
def test_a_redelivery_that_finds_an_earlier_delivery_holding_waits_for_it_to_end(
    app: Celery,
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    expire_lease: Callable[[str], None],
    earlier: str,
    end: str | None,
    policy: str,
    continuation: bool,
) -> None:
    """``acks_late``: the message comes back while a run of it holds the lease. Skipping at once
    would acknowledge the only message left of work whose run may be gone: the redelivery waits
    for the lease, whatever ``on_busy`` says, as long as that run renews it. Once that run
    released it, the work is done: the redelivery is dropped without a state of its own, which
    would overwrite the result of the run (the same task id). A continuation (a child or retry,
    sent with its publisher's header) whose earlier delivery took the lease over from that
    publisher is no different: that newer epoch is the same work's."""
    # Busy retries come back within a second (their countdown is capped at fence_max_ttl).
    app.conf.update(fence_max_ttl=1, fence_default_ttl=1, fence_beat_ttl=1)
    runs: list[int] = []

    @fence.task(lease="release:{environment}", on_busy=policy, acks_late=True, bind=True)
    def publish(self: Any, environment: str) -> str:
        runs.append(self.request.retries)
        return self.fence_holder()

    task_id = str(uuid.uuid4())
    headers: dict[str, Any] = {}
    before: list[tuple[int, str]] = []
    if continuation:
        headers[HEADER], lease, _ = continued_from_a_publisher(
            store, publish, task_id, uuid.uuid4().hex, "celery@lost-host"
        )
        before = [(1, "publisher@test")]
    else:
        # The earlier delivery's holder, as the task makes it, on another worker.
        lease = store.acquire(
            NAME, holder=f"{publish.name}[{task_id}]@celery@lost-host", ttl=60
        ).lease
    assert lease is not None
    epoch, first = lease.epoch, lease.holder
    metrics = fence.store.metrics
    with worker():
        result = publish.apply_async(("prod",), task_id=task_id, headers=headers)
        wait.until(lambda: result.state == states.RETRY, what="the redelivery to wait")
        if earlier == "lost":
            expire_lease(NAME)
            assert wait.finished(result) == end
        else:
            if earlier == "running":
                store.renew(lease)
                wait.until(lambda: metrics.get("busy.wait") == 2, what="a second wait")
            if earlier == "lost, then run elsewhere":
                expire_lease(NAME)
                elsewhere = store.acquire(
                    NAME, holder=first.replace("@celery@lost-host", "@celery@other-host"), ttl=60
                ).lease
                assert elsewhere is not None
                store.release(elsewhere)
            else:
                store.release(lease)
            if earlier == "finished, then paused":
                store.pause(NAME, reason="incident 42")
            elif earlier == "finished, then another run":
                other = store.acquire(NAME, holder="another-message@test", ttl=60).lease
                assert other is not None
                store.release(other)
            wait.until(lambda: metrics.get("busy.duplicate") == 1, what="the redelivery dropped")

    history = store.history(NAME)
    for counter in ("busy.skip", "busy.raise", "busy.retry"):
        assert metrics.get(counter) == 0
    if earlier == "lost":
        assert metrics.get("busy.wait") == 1
        assert len(runs) == 1
        # The same task id, and for a continuation the same publication.
        assert result.result.partition("@")[0] == first.partition("@")[0]
        assert [(entry.epoch, entry.holder) for entry in history] == [
            (epoch + 1, result.result),
            (epoch, first),
            *before,
        ]
    else:
        assert runs == []
        later = {
            "finished, then another run": [(epoch + 1, "another-message@test")],
            "lost, then run elsewhere": [
                (epoch + 1, first.replace("@celery@lost-host", "@celery@other-host"))
            ],
        }.get(earlier, [])
        assert [(entry.epoch, entry.holder) for entry in history] == [
            *later,
            (epoch, first),
            *before,
        ]
        # The state the wait left: nothing of the dropped redelivery's own.
        assert result.state == states.RETRY
    assert store.stale_runs() == []


@pytest.mark.parametrize("earlier", ["lost", "finished"])
def test_a_redelivered_continuation_of_a_task_with_a_minimum_hold_waits_for_its_earlier_delivery(
    app: Celery,
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    expire_lease: Callable[[str], None],
    earlier: str,
) -> None:
    """A task's ``min_hold`` keeps the lease of a run that took it as its owner, not of a
    continuation's, which releases it when it ends: a redelivered retry whose earlier delivery
    took its publisher's lease over waits for that delivery, as without ``min_hold``, instead of
    being skipped, which would acknowledge the only message left of the retry's work."""
    app.conf.update(fence_max_ttl=1, fence_default_ttl=1, fence_beat_ttl=1)
    runs: list[int] = []

    @fence.task(
        lease="release:{environment}", on_busy="skip", min_hold=0.5, acks_late=True, bind=True
    )
    def publish(self: Any, environment: str) -> None:
        runs.append(fence.current().epoch)

    task_id = str(uuid.uuid4())
    header, lease, _ = continued_from_a_publisher(
        store, publish, task_id, uuid.uuid4().hex, "celery@lost-host"
    )
    metrics = fence.store.metrics
    with worker():
        result = publish.apply_async(("prod",), task_id=task_id, headers={HEADER: header})
        wait.until(lambda: result.state == states.RETRY, what="the redelivery to wait")
        if earlier == "lost":
            expire_lease(NAME)
            assert wait.finished(result) == states.SUCCESS
        else:
            store.release(lease)
            wait.until(lambda: metrics.get("busy.duplicate") == 1, what="the redelivery dropped")
    assert (metrics.get("busy.wait"), metrics.get("busy.skip")) == (1, 0)
    assert runs == ([lease.epoch + 1] if earlier == "lost" else [])
    assert store.stale_runs() == []


@pytest.mark.parametrize(
    ("redelivered", "earlier", "runs_again"),
    [
        pytest.param(True, "finished", False, id="redelivered after its earlier delivery ended"),
        pytest.param(True, "lost", True, id="redelivered after its earlier delivery was lost"),
        pytest.param(False, "finished", True, id="the same task id sent again"),
    ],
)
def test_a_redelivery_after_its_earlier_delivery_ran_to_its_end_is_dropped(
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    expire_lease: Callable[[str], None],
    redelivered: bool,
    earlier: str,
    runs_again: bool,
) -> None:
    """The broker delivers the message again after its earlier delivery ran to its end but
    before that delivery was acknowledged (``acks_late``, its worker lost after the run): the
    released lease shows the work is done, and the redelivery is dropped. A redelivery whose
    earlier delivery was lost with the lease runs; so does a message the broker does not flag
    as delivered before (one sent again with the same task id)."""
    runs: list[str] = []

    @fence.task(lease="release:{environment}", acks_late=True)
    def publish(environment: str) -> None:
        runs.append(environment)

    def flag_redelivered(task: Task, **_: Any) -> None:
        # As the broker flags the message (delivery_info["redelivered"]).
        if task.name == publish.name:
            task.request.delivery_info["redelivered"] = redelivered

    task_id = str(uuid.uuid4())
    lease = store.acquire(NAME, holder=f"{publish.name}[{task_id}]@celery@lost-host", ttl=60).lease
    assert lease is not None
    if earlier == "finished":
        store.release(lease)
    else:
        expire_lease(NAME)
    signals.task_prerun.connect(flag_redelivered)
    try:
        with worker():
            result = publish.apply_async(("prod",), task_id=task_id)
            if runs_again:
                assert wait.finished(result) == states.SUCCESS
            else:
                wait.until(
                    lambda: fence.store.metrics.get("busy.duplicate") == 1,
                    what="the redelivery dropped",
                )
    finally:
        signals.task_prerun.disconnect(flag_redelivered)
    assert runs == (["prod"] if runs_again else [])
    epochs = [(entry.epoch, entry.end_reason) for entry in store.history(NAME)]
    assert epochs == ([(2, "released")] if runs_again else []) + [
        (1, earlier.replace("finished", "released").replace("lost", "expired"))
    ]
    assert store.stale_runs() == []


@pytest.mark.parametrize(
    ("requeue", "acks_late", "ends"),
    [
        # Requeued: kept until it expired; the redelivery waited for that, then ran.
        (True, True, [(2, "released"), (1, "expired")]),
        # Acknowledged when it arrived, nothing can put the message back; rejected for good.
        (True, False, [(1, "released")]),
        (False, True, [(1, "released")]),
    ],
)
def test_a_run_whose_message_is_requeued_keeps_its_lease_until_it_expires(
    app: Celery,
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    requeue: bool,
    acks_late: bool,
    ends: list[tuple[int, str]],
) -> None:
    """``Reject(requeue=True)`` puts a message acknowledged late back for a later run: the lease
    is kept until it expires (its renewals stop), since a released one would tell that message's
    redelivery that the work was done. A message rejected for good, or one acknowledged when it
    arrived (nothing can put it back), releases it."""
    app.conf.update(fence_max_ttl=1, fence_default_ttl=1, fence_beat_ttl=1)
    deliveries: list[str] = []

    @fence.task(lease="release:{environment}", acks_late=acks_late)
    def publish(environment: str) -> None:
        deliveries.append(environment)
        if len(deliveries) == 1:
            raise Reject("not now", requeue=requeue)

    with worker():
        publish.apply_async(("prod",))
        wait.until(
            lambda: [(h.epoch, h.end_reason) for h in store.history(NAME)] == ends,
            what=f"the lease history {ends}",
        )
    assert deliveries == ["prod"] * len(ends)


def test_a_child_sharing_its_parents_lease_whose_message_is_requeued_joins_again_at_once(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """A child that joined its parent's held lease and puts its message back
    (``Reject(requeue=True)``) leaves the lease unfinished at once, instead of keeping it until
    it expires: the requeued message joins the same epoch in its place and runs, while the
    parent still holds the lease."""
    runs: list[int | None] = []

    @fence.task(lease="release:{environment}", acks_late=True)
    def child(environment: str) -> None:
        runs.append(fence.current().epoch)
        if len(runs) == 1:
            raise Reject("not now", requeue=True)

    parent = store.acquire(NAME, holder=HOLDER, ttl=60).lease
    assert parent is not None
    header = {**FenceHeader.for_lease(parent, "resume").to_message(), "publication": "f" * 32}
    with worker():
        result = child.apply_async(("prod",), headers={HEADER: header})
        assert wait.finished(result) == states.SUCCESS

    assert runs == [parent.epoch, parent.epoch]
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.holder, owner.state) == (parent.epoch, HOLDER, "held")
    assert store.release(parent) == "released"  # the child's two deliveries both left
    assert fence.store.metrics.get("busy.wait") == 0


@pytest.mark.parametrize("interruption", [SystemExit, KeyboardInterrupt])
@pytest.mark.parametrize("acks_late", [True, False])
def test_a_run_stopped_in_the_middle_keeps_its_lease_until_it_expires(
    app: Celery,
    fence: Fence,
    store: LeaseStore,
    interruption: type[BaseException],
    acks_late: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prefork pool process sent SIGTERM (a cold shutdown, or a service manager stopping the
    worker's processes) raises SystemExit in the body: the work may be unfinished, and its
    message, acknowledged late, may come back. The lease is kept until it expires, renewals
    stopped, so that the redelivery runs then instead of being taken for work done. A message
    acknowledged when it arrived cannot come back, nor can an eager call: they release it. Run
    by Celery's tracer, as a worker runs a task."""
    caplog.set_level(logging.INFO, "celery_fence")

    @fence.task(lease="release:{environment}", acks_late=acks_late)
    def publish(environment: str) -> None:
        raise interruption()

    with pytest.raises(interruption):
        publish.apply(("prod",))
    assert [h.end_reason for h in store.history(NAME)] == ["released"]
    task_id = str(uuid.uuid4())
    request = {"id": task_id, "delivery_info": {"redelivered": False}, "hostname": "w@test"}
    with pytest.raises(interruption):
        build_tracer(publish.name, publish, app=app)(task_id, ("prod",), {}, request=request)
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (2, "held" if acks_late else "released")
    kept = (
        f"keeping lease {NAME} until it expires: the run was interrupted ({interruption.__name__})"
    )
    assert (kept in caplog.messages) == acks_late


def test_a_redelivery_whose_earlier_delivery_ends_as_it_acquires_is_dropped(
    app: Celery,
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The earlier delivery ran to its end between the redelivery's look at the lease and its
    acquisition: the redelivery, holding the next epoch, finds that delivery's release in the
    history, gives the lease back and is dropped."""
    app.conf.update(fence_max_ttl=1, fence_default_ttl=1, fence_beat_ttl=1)
    runs: list[str] = []

    @fence.task(lease="release:{environment}", acks_late=True)
    def publish(environment: str) -> None:
        runs.append(environment)

    task_id = str(uuid.uuid4())
    lease = store.acquire(NAME, holder=f"{publish.name}[{task_id}]@celery@lost-host", ttl=60).lease
    assert lease is not None
    looked = Fence._done_before

    def look_then_end(
        self: Fence, task: FencedTask, name: str, enforced: bool, *rest: Any
    ) -> FencedRun | None:
        done = looked(self, task, name, enforced, *rest)
        owner = store.owner(NAME)
        if task.fence_waited_for() is not None and owner is not None and owner.state == "held":
            store.release(lease)  # the earlier delivery ends now, after the look
        return done

    monkeypatch.setattr(Fence, "_done_before", look_then_end)
    with worker():
        result = publish.apply_async(("prod",), task_id=task_id)
        wait.until(
            lambda: fence.store.metrics.get("busy.duplicate") == 1, what="the redelivery dropped"
        )

    assert runs == []
    history = store.history(NAME)
    assert [(entry.epoch, entry.end_reason) for entry in history] == [
        (2, "released"),
        (1, "released"),
    ]
    assert history[0].holder.startswith(f"{publish.name}[{task_id}]@")
    assert result.state == states.RETRY


@pytest.mark.parametrize("earlier_delivery", ["runs to its end", "is lost"])
def test_a_redelivered_continuation_waits_for_its_earlier_delivery_sharing_the_epoch(
    app: Celery,
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    expire_lease: Callable[[str], None],
    earlier_delivery: str,
) -> None:
    """A child's first delivery joined its parent's held lease; the broker sends its message
    again (past the visibility timeout) while that delivery runs. The redelivery does not join
    beside it at the same epoch: it waits, whatever its busy policy, and is dropped once that
    delivery ran to its end and left the lease; a delivery lost without leaving keeps the
    lease until it expires, and the redelivery then takes it over at the next epoch."""
    # Busy retries come back within a second (their countdown is capped at fence_max_ttl).
    app.conf.update(fence_max_ttl=1, fence_default_ttl=1, fence_beat_ttl=1)
    ran: list[list[Any]] = []

    @fence.task(lease="release:{environment}", on_busy="skip")
    def child(environment: str) -> None:
        run = fence.current()
        ran.append([run.mode, run.epoch])

    task_id = str(uuid.uuid4())
    header, first, parent = continued_from_a_publisher(
        store, child, task_id, uuid.uuid4().hex, "celery@other-host", publisher_ends=False, ttl=3
    )
    assert first.sharer is not None
    metrics = fence.store.metrics
    with worker():
        result = child.apply_async(("prod",), headers={HEADER: header}, task_id=task_id)
        wait.until(lambda: metrics.get("busy.wait") == 1, what="the redelivery to wait")
        assert ran == []
        if earlier_delivery == "runs to its end":
            assert store.release(first) == "left"
            wait.until(lambda: metrics.get("busy.duplicate") == 1, what="the redelivery dropped")
        else:
            assert store.release(parent) == "left"
            expire_lease(NAME)
            assert wait.finished(result) == states.SUCCESS

    if earlier_delivery == "runs to its end":
        assert ran == []
        # The state the wait left: nothing of the dropped redelivery's own.
        assert result.state == states.RETRY
    else:
        assert ran == [["resume", parent.epoch + 1]]
    assert metrics.get("busy.skip") == 0
    assert store.stale_runs() == []


def test_another_message_of_the_same_task_id_is_not_an_earlier_delivery(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """Retries share their task's id, not their message's publication id: a continuation whose
    publisher's epoch was taken over by another message of its task id (a retry sent by a run
    that was superseded, say) is stale, not that message's redelivery."""

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        pass

    task_id = str(uuid.uuid4())
    taken, lease, _ = continued_from_a_publisher(
        store, publish, task_id, uuid.uuid4().hex, "celery@other-host"
    )
    message = {**taken, "publication": uuid.uuid4().hex}
    with worker():
        result = publish.apply_async(("prod",), task_id=task_id, headers={HEADER: message})
        assert wait.finished(result) == REJECTED

    assert result.info["reason"] == "superseded"
    [stale] = store.stale_runs()
    assert (stale.reason, stale.stale_epoch, stale.current_epoch) == ("superseded", 1, 2)
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.holder, owner.state) == (2, lease.holder, "held")


def test_a_task_id_too_long_for_a_holder_names_no_earlier_delivery(fence: Fence) -> None:
    """A holder keeps 200 characters: cut short, the prefix would name other messages' runs."""

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        pass

    def prefix(task_id: str) -> str | None:
        publish.push_request(id=task_id, called_directly=False)
        try:
            return publish.fence_delivery_prefix()
        finally:
            publish.pop_request()

    assert prefix("abc") == f"{publish.name}[abc]@"
    fits = "x" * (200 - len(f"{publish.name}[]@"))
    assert prefix(fits) == f"{publish.name}[{fits}]@"
    assert prefix(fits + "x") is None


def test_a_chord_whose_parts_are_refused_fails_instead_of_waiting_forever(
    app: Celery,
    fence: Fence,
    probe: Callable[..., Probe],
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
) -> None:
    """Directly, or as the first task of a chain that is a part: a refused task's chain links
    never run, so the chain's last link, which the chord waits for, fails with it."""
    publish = probe(on_busy="skip")
    collected: list[Any] = []

    @app.task(shared=False)
    def collect(parts: list[Any]) -> None:
        collected.append(parts)

    @app.task(shared=False)
    def then(value: object) -> object:
        return value

    epoch = hold(store, NAME)
    with worker():
        result = chord(
            [publish.task.si("prod"), chain(publish.task.si("prod"), then.s())], collect.s()
        ).delay()
        assert wait.finished(result) == states.FAILURE
        direct, chained = result.parent.results
        parts = [app.AsyncResult(part.id) for part in (direct, chained.parent, chained)]

    assert isinstance(result.result, ChordError)
    assert "LeaseHeldError" in str(result.result)
    assert [part.state for part in parts] == [states.FAILURE] * 3
    assert all(isinstance(part.result, LeaseHeldError) for part in parts)
    assert f"held by {HOLDER} (epoch {epoch})" in str(parts[0].result)
    assert collected == []
    assert not publish.ran.is_set()
    assert fence.store.metrics.get("busy.skip") == 2


def test_the_links_of_a_chain_after_a_skipped_task_end_skipped_too(
    app: Celery,
    probe: Callable[..., Probe],
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
) -> None:
    """They never run; the chain's result, its last link, says why, as after a failure."""
    publish = probe(on_busy="skip")
    ran: list[object] = []

    @app.task(shared=False)
    def then(value: object) -> None:
        ran.append(value)

    epoch = hold(store, NAME)
    with worker():
        result = chain(publish.task.si("prod"), then.s(), then.s()).delay()
        assert wait.finished(result) == SKIPPED
        links = [result.parent.parent, result.parent, result]
        assert [wait.finished(link) for link in links] == [SKIPPED] * 3
        # A chord in the chain: the chain's result is its body's.
        into_chord = chain(
            publish.task.si("prod"), chord([then.si(1), then.si(2)], then.s())
        ).delay()
        assert wait.finished(into_chord) == SKIPPED

    assert {link.info["owner_epoch"] for link in links} == {epoch}
    assert result.info == links[0].info
    assert into_chord.info == links[0].info
    assert (result.info["lease"], result.info["reason"]) == (NAME, "held")
    assert ran == []
    assert not publish.ran.is_set()


@pytest.mark.parametrize(
    ("policy", "retried", "busy_retries"),
    [
        ("raise", 0, None),
        ("retry", 1, None),
        # A message that already had its busy retries fails at its next refusal.
        ("retry", 0, 1),
        # A busy retry count that is not a non-negative integer counts as none.
        ("retry", 1, -5),
        ("retry", 1, "9"),
    ],
)
def test_busy_raise_and_exhausted_retries_fail_with_lease_held_error(
    app: Celery,
    fence: Fence,
    probe: Callable[..., Probe],
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    failures: dict[str, BaseException],
    policy: str,
    retried: int,
    busy_retries: object,
) -> None:
    # One retry at most; its countdown, the owner's remaining time, is capped at fence_max_ttl.
    app.conf.update(
        fence_busy_max_retries=1, fence_max_ttl=0.5, fence_default_ttl=0.5, fence_beat_ttl=0.5
    )
    publish = probe(on_busy=policy)
    epoch = hold(store, NAME)
    headers = {} if busy_retries is None else {BUSY_RETRIES: busy_retries}
    with worker():
        result = publish.task.apply_async(("prod",), headers=headers)
        assert wait.finished(result) == states.FAILURE

    error = failures[result.id]
    assert isinstance(error, LeaseHeldError)
    assert error.owner is not None
    assert (error.lease_name, error.reason, error.owner.holder, error.owner.epoch) == (
        NAME,
        "held",
        HOLDER,
        epoch,
    )
    # Through the JSON result backend the caller gets the same error, its fields included.
    caller = result.result
    assert type(caller) is type(error)
    assert (caller.lease_name, caller.reason, caller.epoch, caller.owner) == (
        error.lease_name,
        error.reason,
        error.epoch,
        error.owner,
    )
    assert str(caller) == str(error)
    assert f"held by {HOLDER} (epoch {epoch})" in str(caller)
    # Each refusal counts as what it did: retried, or raised (the retry past the bound too).
    assert (fence.store.metrics.get("busy.retry"), fence.store.metrics.get("busy.raise")) == (
        retried,
        1,
    )
    assert not publish.ran.is_set()


def test_body_fences_its_writes_with_the_run_lease(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, engine: Engine
) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE manifest (environment text PRIMARY KEY, release int)")

    @fence.task(lease="release:{environment}")
    def publish(environment: str, release: int) -> None:
        params = {"environment": environment, "release": release}
        # In a transaction of the caller's own, or in one the fence opens.
        with engine.begin() as conn, fence.current().guard("publish manifest", conn):
            conn.execute(sa.text("INSERT INTO manifest VALUES (:environment, 0)"), params)
        with fence.guard("set release") as own:
            own.execute(
                sa.text("UPDATE manifest SET release = :release WHERE environment = :environment"),
                params,
            )

    with worker():
        assert wait.finished(publish.delay("prod", 7)) == states.SUCCESS

    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT * FROM manifest").all() == [("prod", 7)]
    assert fence.store.metrics.get("guard.passed") == 2
    assert store.stale_runs() == []


def test_lease_is_released_when_the_body_fails(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        raise RuntimeError("manifest upload failed")

    with worker():
        result = publish.delay("prod")
        assert wait.finished(result) == states.FAILURE

    assert "manifest upload failed" in str(result.result)
    owner = store.owner(NAME)
    assert owner is not None
    assert owner.state == "released"
    [entry] = store.history(NAME)
    assert entry.end_reason == "released"
    assert hold(store, NAME) == 2


def test_a_release_kept_waiting_by_a_fenced_writer_leaves_the_lease_to_expire(
    app: Celery, fence: Fence, engine: Engine, store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that ends while a fenced write of its own is still open (a transaction its body
    left open) cannot release the row that write holds: the release gives up after
    ``fence_lock_timeout``, the run ends with one warning, and the lease is left to expire."""
    app.conf.fence_lock_timeout = 0.2
    left_open: list[sa.Connection] = []

    @fence.task(lease="release:{environment}", ttl=5)
    def publish(environment: str) -> str:
        conn = engine.connect()
        left_open.append(conn)
        conn.begin()
        with fence.current().guard("publish manifest", conn):
            conn.exec_driver_sql("SELECT 1")
        # The fence sets the session's idle timeout to the lease's remaining time: a release
        # that waited without bound would wait for the server to end this session.
        return "published"

    try:
        with caplog.at_level(logging.WARNING, "celery_fence"):
            assert publish.apply(("prod",)).get() == "published"
    finally:
        for conn in left_open:
            conn.close()
    [warning] = [r.getMessage() for r in caplog.records if r.name == "celery_fence"]
    assert warning.startswith("could not release lease release:prod (it will expire): ")
    assert "not released" in warning
    assert fence.store.metrics.get("release.busy") == 1
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "held")
    assert store.stale_runs() == []


def test_min_hold_keeps_the_lease_after_a_fast_run(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    @fence.task(lease="nightly:{day}", min_hold=30)
    def nightly(day: str) -> int | None:
        return fence.current().epoch

    with worker():
        assert wait.outcome(nightly.delay("monday")) == 1
        again = nightly.delay("monday")
        assert wait.finished(again) == SKIPPED

    owner = store.owner("nightly:monday")
    assert owner is not None
    assert owner.state == "held"
    assert (owner.expires_at - owner.acquired_at).total_seconds() == pytest.approx(30, abs=1)
    [entry] = store.history("nightly:monday")
    assert entry.ended_at is None
    assert again.info["owner_epoch"] == 1


def test_a_min_hold_run_that_renews_keeps_the_lease_for_min_hold_from_when_it_took_it(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """Renewals extend the lease by its TTL, not by ``min_hold``: a run that renewed it does
    not keep it into the next period."""

    @fence.task(lease="nightly:{day}", ttl=5, min_hold=60)
    def nightly(day: str) -> int | None:
        run = fence.current()
        assert run.keeper is not None
        assert run.keeper.renew_once() is not None
        return run.epoch

    with worker():
        assert wait.outcome(nightly.delay("monday")) == 1

    owner = store.owner("nightly:monday")
    assert owner is not None
    assert owner.state == "held"
    assert owner.renewed_at > owner.acquired_at
    assert owner.expires_at == owner.acquired_at + timedelta(seconds=60)


def test_a_retry_of_a_min_hold_task_keeps_the_period_its_first_run_took(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    @fence.task(lease="nightly:{day}", ttl=5, min_hold=60, renew_interval=1, bind=True)
    def nightly(self: Any, day: str) -> list[Any]:
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        run = fence.current()
        return [run.mode, run.epoch]

    with worker():
        assert wait.outcome(nightly.delay("monday")) == ["resume", 1]

    owner = store.owner("nightly:monday")
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "held")
    assert (owner.expires_at - owner.acquired_at).total_seconds() == pytest.approx(60, abs=1)
    assert store.stale_runs() == []


def test_shadow_mode_runs_a_busy_body_and_only_in_its_environment(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    app.conf.fence_enforcement = {"test": "shadow", "*": "enforce"}

    @fence.task(lease="release:{environment}", environment="{environment}")
    def publish(environment: str) -> list[Any]:
        run = fence.current()
        return [run.enforced, run.lease is None]

    hold(store, "release:test", environment="test")
    hold(store, NAME, environment="prod")
    with worker():
        shadowed = publish.delay("test")
        enforced = publish.delay("prod")
        assert wait.outcome(shadowed) == [False, True]
        assert wait.finished(enforced) == SKIPPED

    assert fence.store.metrics.get("shadow.held") == 1
    assert [e.holder for e in store.history("release:test")] == [HOLDER]


def test_enforcement_off_runs_unfenced_and_takes_no_lease(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, engine: Engine
) -> None:
    app.conf.fence_enforcement = {"test": "off", "*": "enforce"}
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE manifest (environment text PRIMARY KEY)")

    @fence.task(lease="release:{environment}", environment="{environment}")
    def publish(environment: str) -> list[Any]:
        run = fence.current()
        assert current_run() is run
        with run.guard("publish manifest") as conn:
            conn.execute(sa.text("INSERT INTO manifest VALUES (:e)"), {"e": environment})
        return [run.lease, run.enforced]

    with worker():
        assert wait.outcome(publish.delay("test")) == [None, False]

    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT * FROM manifest").all() == [("test",)]
    assert store.leases() == []
    assert store.history("release:test") == []
    assert store.stale_runs() == []
