"""The ``celery_fence`` header: continuations run under their publisher's lease, or not at all.

Children, canvas members and retries of a fenced run carry its header. A continuation on the
task's own lease shares the publisher's epoch while it is held, or takes the lease over at the
next epoch once it was released. A header whose epoch was superseded, whose proof does not match,
or that cannot be read rejects the run before its body: the result is REJECTED, never SUCCESS,
and the stale run is recorded.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pytest
from celery import Celery, Task, chain, chord, group, states
from celery.result import AsyncResult
from sqlalchemy.engine import Engine

from celery_fence import Lease, LeaseHeldError, LeaseLostError, LeaseStore
from celery_fence.contrib.celery import (
    HEADER,
    REJECTED,
    SKIPPED,
    Fence,
    FencedRun,
    FenceHeader,
)
from celery_fence.contrib.celery.fence import WAITING
from celery_fence.contrib.celery.headers import MAX_OUTER
from celery_fence.store import Mode

if TYPE_CHECKING:
    from conftest import Probe, StartWorker, Wait

HOLDER = "release-job@test"
NAME = "release:prod"
#: What ran, in which mode, at which epoch.
Seen = list[tuple[str, str, int | None]]


def take(store: LeaseStore, name: str = NAME, holder: str = HOLDER) -> Lease:
    got = store.acquire(name, holder=holder, ttl=60, environment="default")
    assert got.lease is not None, got
    return got.lease


def beat_run(run: FencedRun) -> list[Any]:
    """What a run the beat sent runs under: its mode, its own lease and epoch, and the beat's
    lease and epoch."""
    assert run.lease is not None
    assert run.dispatched_by is not None
    lease, beat = run.lease, run.dispatched_by
    return [run.mode, lease.name, lease.epoch, beat.lease, beat.epoch]


def run_with_header(task: Any, header: object, *args: Any) -> AsyncResult:
    """Send ``task`` as a continuation would arrive: with a ``celery_fence`` header."""
    result: AsyncResult = task.apply_async(args, headers={HEADER: header})
    return result


def rejected(publish: Probe, header: object, worker: StartWorker, wait: Wait) -> AsyncResult:
    """Run the probe with ``header``: it ends REJECTED, and its body never runs."""
    with worker():
        result = run_with_header(publish.task, header, "prod")
        assert wait.finished(result) == REJECTED
    assert not publish.ran.is_set()
    return result


def assert_still_held(store: LeaseStore, epoch: int) -> None:
    """The rejection left the lease as it was."""
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.holder, owner.state) == (epoch, HOLDER, "held")


# Each: pool, concurrency, the epoch the child runs at, the epochs in the lease's history.
CHILD_TIMELINES = [
    # Solo pool: the parent ended (and released) before the child started, so the child took
    # the lease over at the next epoch.
    pytest.param("solo", 1, 2, [2, 1], id="after the parent ended"),
    # Threads pool: the child started while the parent held the lease and joined it as one more
    # sharer, so the lease outlived the parent's end.
    pytest.param("threads", 2, 1, [1], id="while the parent holds"),
]


@pytest.mark.parametrize(("pool", "concurrency", "child_epoch", "epochs"), CHILD_TIMELINES)
def test_child_on_the_parent_lease_continues_the_run(
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    app: Celery,
    pool: str,
    concurrency: int,
    child_epoch: int,
    epochs: list[int],
) -> None:
    child_started = threading.Event()

    @fence.task(lease="release:{environment}", bind=True)
    def parent(self: Any, environment: str) -> list[Any]:
        sent = child.delay(environment, self.request.id)
        if concurrency > 1:
            assert child_started.wait(10)
        run = fence.current()
        assert run.lease is not None
        return [run.epoch, run.lease.holder, sent.id]

    # The parent's lease template, filled to the same name: the child continues the run.
    @fence.task(lease="release:{environment}")
    def child(environment: str, parent_id: str) -> list[Any]:
        run = fence.current()
        assert run.lease is not None
        child_started.set()
        wait.until(lambda: app.AsyncResult(parent_id).ready(), what="the parent to end")
        owner = fence.store.owner(NAME)
        assert owner is not None
        return [run.mode, run.lease.name, run.epoch, run.held, owner.epoch, owner.state]

    with worker(pool=pool, concurrency=concurrency):
        epoch, holder, child_id = wait.outcome(parent.delay("prod"))
        seen = wait.outcome(app.AsyncResult(child_id))
        # The child releases the lease as its last sharer.
        wait.until(lambda: store.history(NAME)[0].end_reason, what="the child's release")

    assert epoch == 1
    assert seen == ["resume", NAME, child_epoch, True, child_epoch, "held"]
    history = store.history(NAME)
    assert [entry.epoch for entry in history] == epochs
    assert {entry.end_reason for entry in history} == {"released"}
    # The parent's epoch is held in its name; a take-over goes on in the child's, with the
    # publication id of the child's message.
    assert history[-1].holder == holder
    assert all(
        re.match(rf"{re.escape(child.name)}\[{child_id}\]#[0-9a-f]{{32}}@", entry.holder)
        for entry in history[:-1]
    )
    assert [owner.name for owner in store.leases()] == [NAME]
    assert store.stale_runs() == []


def canvas_of(kind: str, step: Any, collect: Any, environment: str) -> Any:
    """Three steps as a group, a chain (each link published by the worker after the one before
    it), a chord (whose callback the worker publishes after the last part), a starmap or two
    chunks."""
    steps = [step.si(environment, n) for n in range(3)]
    if kind == "group":
        return group(steps)
    if kind == "chain":
        return chain(*steps)
    # celery.starmap calls each item as a function, in its own run; chunks are starmaps.
    if kind == "starmap":
        return step.starmap([(environment, n) for n in range(3)])
    if kind == "chunks":
        return step.chunks([(environment, n) for n in range(3)], 2)
    return chord(steps, collect.s(environment))


def canvas_tasks(fence: Fence, kind: str, seen: Seen, hold: Callable[[], None]) -> Any:
    """A parent that publishes the canvas of ``kind`` and then calls ``hold``. Its members are
    on the parent's lease and note in ``seen`` what ran, in which mode, at which epoch."""

    def record(what: str) -> None:
        run = fence.current()
        seen.append((what, run.mode, run.epoch))

    @fence.task(lease="release:{environment}")
    def parent(environment: str) -> None:
        canvas_of(kind, step, collect, environment).delay()
        hold()

    @fence.task(lease="release:{environment}")
    def step(environment: str, n: int) -> int:
        record(f"step {n}")
        return n

    @fence.task(lease="release:{environment}")
    def collect(parts: list[int], environment: str) -> None:
        record(f"collect {sorted(parts)}")

    return parent


def test_an_eager_or_direct_child_continues_its_parent_run(
    app: Celery, fence: Fence, store: LeaseStore
) -> None:
    """``task_always_eager`` (and ``apply()``) runs a child in the parent's run, as a worker
    would run it beside the parent: it shares the parent's epoch instead of being refused. So
    does a child called as a function there."""
    app.conf.task_always_eager = True

    @fence.task(lease="release:{environment}")
    def child(environment: str) -> list[Any]:
        run = fence.current()
        return [run.mode, run.epoch]

    @fence.task(lease="release:{environment}")
    def parent(environment: str) -> list[Any]:
        return [
            child.delay(environment).result,
            child.apply((environment,)).result,
            child(environment),
        ]

    @fence.task(lease="release:{environment}", bind=True)
    def recurse(self: Any, environment: str, depth: int) -> Any:
        # A task that calls itself continues its run through apply() (see headers.md).
        if depth:
            return recurse.apply((environment, depth - 1)).get()
        return [fence.current().mode, fence.current().epoch]

    assert parent.delay("prod").get() == [["resume", 1], ["resume", 1], ["resume", 1]]
    assert recurse.apply(("prod", 1)).get() == ["resume", 2]
    assert [(entry.epoch, entry.end_reason) for entry in store.history(NAME)] == [
        (2, "released"),
        (1, "released"),
    ]
    assert store.stale_runs() == []


def test_an_eager_run_refused_or_rejected_raises_and_an_eager_chord_calls_no_body(
    app: Celery, fence: Fence, store: LeaseStore
) -> None:
    """Eagerly, a skipped part would hand its chord's body ``None``: a refused run raises the
    error instead, whatever its policy, as does a continuation rejected as stale."""
    app.conf.task_always_eager = True
    bodies: list[Any] = []

    @fence.task(lease="release:{environment}")
    def part(environment: str) -> int:
        return 1

    @app.task(shared=False)
    def body(parts: list[int]) -> None:
        bodies.append(parts)

    other = take(store, holder="other-job@test")
    with pytest.raises(LeaseHeldError) as refused:
        chord([part.si("prod"), part.si("prod")], body.s()).delay()
    assert refused.value.owner is not None
    assert refused.value.owner.holder == "other-job@test"
    assert bodies == []

    header = FenceHeader.for_lease(other, "resume").to_message()
    store.release(other)
    take(store)
    result = part.apply(("prod",), headers={HEADER: header})
    assert result.state == states.FAILURE
    assert isinstance(result.result, LeaseLostError)
    assert result.result.reason == "superseded"
    [stale] = store.stale_runs(lease_name=NAME)
    assert (stale.stale_epoch, stale.current_epoch) == (1, 2)


def test_a_run_passes_on_the_nearest_other_leases_and_logs_those_it_drops(
    app: Celery, fence: Fence, store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.task_always_eager = True
    caplog.set_level(logging.WARNING, "celery_fence")

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> list[str]:
        header = fence.current().header()
        assert header is not None
        return [entry.lease for entry in header.outer]

    build = take(store, "build:0")
    outer = [outer_entry(build, name=f"build:{n}") for n in range(1, MAX_OUTER + 1)]
    header = {**FenceHeader.for_lease(build, "resume").to_message(), "outer": outer}

    passed_on = publish.apply(("prod",), headers={HEADER: header}).get()

    assert passed_on == [f"build:{n}" for n in range(MAX_OUTER)]
    assert (
        f"a run on lease {NAME} passes on the headers of the {MAX_OUTER} nearest of "
        f"{MAX_OUTER + 1} other leases; dropped: build:{MAX_OUTER}"
    ) in caplog.text


def test_a_task_calling_itself_in_its_run_is_refused_whatever_its_policy(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """Celery gives the inner call the outer run's request: it is refused, not retried (a retry
    would end the outer run and send it again, each time)."""

    @fence.task(lease="release:{environment}", on_busy="retry", bind=True)
    def recurse(self: Any, environment: str, depth: int) -> Any:
        if depth:
            try:
                recurse(environment, depth - 1)
            except LeaseHeldError as exc:
                return ["refused", exc.owner.epoch if exc.owner else None]
        return ["ran", fence.current().epoch]

    with worker():
        result = recurse.apply_async(("prod", 1))
        assert wait.finished(result) == states.SUCCESS

    assert result.result == ["refused", 1]
    assert fence.store.metrics.get("busy.wait") == 0
    assert [(entry.epoch, entry.end_reason) for entry in store.history(NAME)] == [(1, "released")]


def test_a_task_calling_itself_for_another_lease_acquires_it_at_each_call(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """Called for another lease, the inner call runs under a lease of its own, each time: it
    shares the outer run's request, whose header it leaves as it found it, so the second call
    is not taken for a continuation of the first."""
    seen: Seen = []

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        run = fence.current()
        seen.append((environment, run.mode, run.epoch))
        if environment == "prod":
            publish("staging")
            publish("staging")

    with worker():
        assert wait.finished(publish.delay("prod")) == states.SUCCESS

    assert seen == [("prod", "owner", 1), ("staging", "owner", 1), ("staging", "owner", 2)]
    assert store.stale_runs() == []


@pytest.mark.parametrize("kind", ["group", "chain", "chord", "starmap", "chunks"])
def test_canvas_members_started_while_the_parent_holds_share_its_epoch(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, kind: str
) -> None:
    seen: Seen = []
    expected = 4 if kind == "chord" else 3

    def hold() -> None:
        # The parent keeps the lease until every member has started (and joined it).
        wait.until(lambda: len(seen) == expected, what=f"{expected} members of the {kind}")

    parent = canvas_tasks(fence, kind, seen, hold)
    with worker(pool="threads", concurrency=2):
        assert wait.finished(parent.delay("prod")) == states.SUCCESS
        wait.until(lambda: store.history(NAME)[0].end_reason, what="the last sharer's release")

    callback = ["collect [0, 1, 2]"] if kind == "chord" else []
    assert sorted(what for what, _, _ in seen) == sorted(["step 0", "step 1", "step 2", *callback])
    assert {(mode, epoch) for _, mode, epoch in seen} == {("resume", 1)}
    [entry] = store.history(NAME)
    assert entry.end_reason == "released"
    assert [owner.name for owner in store.leases()] == [NAME]
    assert store.stale_runs() == []


@pytest.mark.parametrize("kind", ["chain", "starmap"])
def test_chain_links_after_the_parent_ended_each_take_the_lease_over(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, kind: str
) -> None:
    """Solo pool: each link starts after the run before it released the lease, and carries the
    header of that run (published by the worker after its body); each item of a starmap, called
    in one task, continues from the item before it."""
    seen: Seen = []

    parent = canvas_tasks(fence, kind, seen, lambda: None)
    with worker():
        assert wait.finished(parent.delay("prod")) == states.SUCCESS
        wait.until(lambda: len(seen) == 3, what="the three links")
        wait.until(lambda: store.history(NAME)[0].end_reason, what="the last link's release")

    assert seen == [("step 0", "resume", 2), ("step 1", "resume", 3), ("step 2", "resume", 4)]
    history = store.history(NAME)
    assert [entry.epoch for entry in history] == [4, 3, 2, 1]
    assert {entry.end_reason for entry in history} == {"released"}
    assert store.stale_runs() == []


@pytest.mark.parametrize("superseded", [False, True], ids=["current", "superseded"])
def test_a_link_after_a_step_on_another_lease_continues_the_run_that_published_the_chain(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, superseded: bool
) -> None:
    """A release publishes chain(build, publish): build takes a lease of its own, and the header
    it passes on to publish still carries the release's entry. Publish continues the release,
    or, once a newer release took (and gave back) the lease, is rejected as superseded."""
    seen: Seen = []
    chains: list[AsyncResult] = []

    @fence.task(lease="release:{environment}")
    def release(environment: str) -> None:
        chains.append(chain(build.si(environment), publish.si(environment)).delay())

    @fence.task(lease="build:{environment}")
    def build(environment: str) -> None:
        run = fence.current()
        seen.append(("build", run.mode, run.epoch))
        if superseded:
            store.release(take(store, holder="newer-release@test"))

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        run = fence.current()
        seen.append(("publish", run.mode, run.epoch))

    with worker():
        assert wait.finished(release.delay("prod")) == states.SUCCESS
        state = wait.finished(wait.until(lambda: chains, what="the chain")[0])

    if superseded:
        assert (state, seen) == (REJECTED, [("build", "owner", 1)])
        [stale] = store.stale_runs(lease_name=NAME)
        assert (stale.reason, stale.stale_epoch, stale.current_epoch) == ("superseded", 1, 2)
        assert stale.action == f"start {publish.name}"
    else:
        assert state == states.SUCCESS
        assert seen == [("build", "owner", 1), ("publish", "resume", 2)]
        assert [entry.epoch for entry in store.history(NAME)] == [2, 1]
        assert store.stale_runs() == []


@pytest.mark.parametrize("between", ["enforcement off", "shadow, refused"])
def test_a_step_without_a_lease_still_passes_on_the_release_it_was_published_under(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, between: str
) -> None:
    """release, then chain(build, publish): build runs without a lease (its environment's
    enforcement off, or shadow mode letting it through a held lease), and passes the release's
    entry on all the same, so that publish is rejected once a newer release took the lease."""
    app.conf.fence_enforcement = {"ci": "off" if between == "enforcement off" else "shadow"}
    if between == "shadow, refused":
        take(store, "build:ci", holder="another-build@test")
    chains: list[AsyncResult] = []

    @fence.task(lease="release:{environment}")
    def release(environment: str) -> None:
        chains.append(chain(build.si("ci"), publish.si(environment)).delay())

    @fence.task(lease="build:{environment}", environment="{environment}")
    def build(environment: str) -> None:
        assert fence.current().lease is None
        store.release(take(store, holder="newer-release@test"))

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        raise AssertionError("a superseded release published")

    with worker():
        assert wait.finished(release.delay("prod")) == states.SUCCESS
        assert wait.finished(wait.until(lambda: chains, what="the chain")[0]) == REJECTED

    [stale] = store.stale_runs(lease_name=NAME)
    assert (stale.reason, stale.stale_epoch, stale.current_epoch) == ("superseded", 1, 2)


def test_group_members_after_the_parent_ended_take_it_over_once(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """Siblings carry the same header, like two deliveries of one message: the first to start
    takes the released lease over, the others then find a newer epoch and are rejected."""
    seen: Seen = []

    parent = canvas_tasks(fence, "group", seen, lambda: None)
    with worker():
        assert wait.finished(parent.delay("prod")) == states.SUCCESS
        wait.until(lambda: len(store.stale_runs()) == 2, what="two siblings to be rejected")

    assert [(mode, epoch) for _, mode, epoch in seen] == [("resume", 2)]
    stale = store.stale_runs(lease_name=NAME)
    assert {(run.reason, run.stale_epoch, run.current_epoch) for run in stale} == {
        ("superseded", 1, 2)
    }
    assert [entry.epoch for entry in store.history(NAME)] == [2, 1]


def test_retry_after_the_run_ended_takes_the_lease_over(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    seen: list[tuple[int, str, int | None]] = []

    @fence.task(lease="release:{environment}", bind=True)
    def publish(self: Any, environment: str) -> str:
        run = fence.current()
        seen.append((self.request.retries, run.mode, run.epoch))
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return "published"

    with worker():
        assert wait.outcome(publish.delay("prod")) == "published"
        wait.until(lambda: store.history(NAME)[0].end_reason, what="the retry's release")

    # The first run released epoch 1 when it ended; its retry took the lease over at epoch 2.
    assert seen == [(0, "owner", 1), (1, "resume", 2)]
    history = store.history(NAME)
    assert [(entry.epoch, entry.end_reason) for entry in history] == [
        (2, "released"),
        (1, "released"),
    ]
    # The retry took over in the first run's name (the same task id, on the same worker), with
    # the publication id of the retry's message.
    first, _, host = history[1].holder.partition("@")
    assert re.fullmatch(rf"{re.escape(first)}#[0-9a-f]{{32}}@{re.escape(host)}", history[0].holder)
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (2, "released")
    assert store.stale_runs() == []


def test_retry_after_another_holder_took_the_lease_is_rejected(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    retries = f"{app.conf.task_default_queue}-retries"
    attempts: list[int] = []

    @fence.task(lease="release:{environment}", bind=True)
    def publish(self: Any, environment: str) -> None:
        attempts.append(self.request.retries)
        raise self.retry(countdown=0, queue=retries)

    # The first worker does not consume the retries: the retry waits in its queue while the
    # lease, released when the first run ended, goes to another holder.
    with worker():
        result = publish.delay("prod")
        wait.until(lambda: result.state == states.RETRY, what="the run to retry")
    ended = wait.until(lambda: store.history(NAME)[0].end_reason, what="the first run's end")
    assert ended == "released"
    assert take(store).epoch == 2
    with worker(queues=[retries]):
        assert wait.finished(result) == REJECTED

    assert attempts == [0]
    assert result.info["reason"] == "superseded"
    assert (result.info["epoch"], result.info["owner_epoch"]) == (1, 2)
    [stale] = store.stale_runs(lease_name=NAME)
    assert (stale.reason, stale.stale_epoch, stale.current_epoch, stale.current_holder) == (
        "superseded",
        1,
        2,
        HOLDER,
    )
    assert stale.action == f"start {publish.name}"
    assert stale.enforced


def test_stale_header_is_rejected_before_the_body_and_recorded(
    fence: Fence, probe: Callable[..., Probe], worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    publish = probe()

    @fence.task(lease="other")
    def later() -> str:
        return "done"

    old = take(store, holder="old-job@test")
    header = FenceHeader.for_lease(old, "resume").to_message()
    store.release(old)
    current = take(store)
    with worker():
        result = run_with_header(publish.task, header, "prod")
        assert wait.finished(result) == REJECTED
        # One task at a time: once the next one is done, the rejected one is over.
        assert wait.outcome(later.delay()) == "done"

    assert result.state == REJECTED
    assert not publish.ran.is_set()
    assert (result.info["lease"], result.info["reason"]) == (NAME, "superseded")
    assert (result.info["owner_holder"], result.info["owner_epoch"]) == (HOLDER, current.epoch)
    [stale] = store.stale_runs(lease_name=NAME)
    assert (stale.stale_epoch, stale.stale_holder, stale.current_epoch) == (1, "old-job@test", 2)
    assert (stale.reason, stale.current_holder, stale.enforced) == ("superseded", HOLDER, True)
    assert stale.action == "start probe.publish"
    assert_still_held(store, current.epoch)


def test_a_header_for_a_lease_that_does_not_exist_is_recorded_in_the_tasks_environment(
    probe: Callable[..., Probe], worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    publish = probe(environment="{environment}")
    now = datetime.now(timezone.utc)
    never_taken = Lease(
        name=NAME,
        environment="prod",
        holder=HOLDER,
        purpose="",
        epoch=1,
        token=uuid.uuid4(),
        acquired_at=now,
        expires_at=now,
        hold_until=now,
        ttl=60,
        deadline=0.0,
    )

    result = rejected(
        publish, FenceHeader.for_lease(never_taken, "join").to_message(), worker, wait
    )

    assert result.info["reason"] == "missing"
    [stale] = store.stale_runs(environment="prod")
    assert (stale.lease_name, stale.reason, stale.stale_epoch) == (NAME, "missing", 1)
    assert store.owner(NAME) is None


FORGERIES: dict[str, Callable[[Lease], dict[str, Any]]] = {
    # The right epoch and holder, signed with a token the publisher never had.
    "other token": lambda lease: FenceHeader.for_lease(
        dataclasses.replace(lease, token=uuid.uuid4()), "resume"
    ).to_message(),
    # An epoch that was never handed out.
    "future epoch": lambda lease: FenceHeader.for_lease(
        dataclasses.replace(lease, epoch=lease.epoch + 1), "resume"
    ).to_message(),
    # A genuine proof, presented under another holder's name.
    "other holder": lambda lease: {
        **FenceHeader.for_lease(lease, "resume").to_message(),
        "holder": "intruder@test",
    },
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_header_is_rejected_and_recorded(
    probe: Callable[..., Probe], worker: StartWorker, store: LeaseStore, wait: Wait, forgery: str
) -> None:
    publish = probe()
    lease = take(store)
    header = FORGERIES[forgery](lease)

    result = rejected(publish, header, worker, wait)

    assert result.info["reason"] == "forged"
    [stale] = store.stale_runs(lease_name=NAME)
    assert (stale.reason, stale.stale_epoch, stale.stale_holder) == (
        "forged",
        header["epoch"],
        header["holder"],
    )
    assert_still_held(store, lease.epoch)


def malformed(lease: Lease, **changes: Any) -> dict[str, Any]:
    """A genuine header with some fields changed; a field set to ``None`` is left out."""
    message = {**FenceHeader.for_lease(lease, "resume").to_message(), **changes}
    return {key: value for key, value in message.items() if value is not None}


def outer_entry(lease: Lease, mode: Mode = "resume", name: str = "build:prod") -> dict[str, Any]:
    """An entry of another lease than ``lease``'s, as a header's ``outer`` carries it."""
    return FenceHeader.for_lease(dataclasses.replace(lease, name=name), mode).to_message()


MALFORMED: dict[str, Callable[[Lease], object]] = {
    "missing proof": lambda lease: malformed(lease, proof=None),
    "missing epoch": lambda lease: malformed(lease, epoch=None),
    "epoch not an integer": lambda lease: malformed(lease, epoch=str(lease.epoch)),
    "epoch beyond bigint": lambda lease: malformed(lease, epoch=2**63),
    "holder not a holder": lambda lease: malformed(lease, holder=f" {lease.holder} "),
    "unknown mode": lambda lease: malformed(lease, mode="steal"),
    "proof not hex": lambda lease: malformed(lease, proof="z" * 64),
    "publication not hex": lambda lease: malformed(lease, publication="z" * 32),
    "publication ending in a newline": lambda lease: malformed(lease, publication="a" * 32 + "\n"),
    "proof ending in a newline": lambda lease: malformed(lease, proof="a" * 64 + "\n"),
    "not a mapping": lambda lease: f"{lease.name}@{lease.epoch}",
    "outer not a list": lambda lease: malformed(lease, outer="build:prod"),
    "outer entry of the header's own lease": lambda lease: malformed(
        lease, outer=[outer_entry(lease, name=lease.name)]
    ),
    "outer entry in join mode": lambda lease: malformed(lease, outer=[outer_entry(lease, "join")]),
    "outer entry with a publication": lambda lease: malformed(
        lease, outer=[{**outer_entry(lease), "publication": "a" * 32}]
    ),
    "more outer entries than travel": lambda lease: malformed(
        lease, outer=[outer_entry(lease, name=f"build:{n}") for n in range(MAX_OUTER + 1)]
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_header_is_rejected_and_recorded(
    probe: Callable[..., Probe], worker: StartWorker, store: LeaseStore, wait: Wait, case: str
) -> None:
    publish = probe()
    lease = take(store)

    result = rejected(publish, MALFORMED[case](lease), worker, wait)

    assert result.info["reason"] == "malformed"
    assert "celery_fence header" in result.info["message"]
    [stale] = store.stale_runs()
    readable = case != "not a mapping"
    assert stale.lease_name == (NAME if readable else "(unreadable)")
    holder_readable = readable and case != "holder not a holder"
    assert stale.stale_holder == (HOLDER if holder_readable else "(unreadable)")
    assert (stale.reason, stale.stale_epoch, stale.enforced) == ("malformed", None, True)
    assert_still_held(store, lease.epoch)


@pytest.mark.parametrize("lease_ends", ["released", "expired"])
def test_join_header_runs_on_its_own_lease_while_held_and_is_rejected_after(
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    expire_lease: Callable[[str], None],
    lease_ends: str,
) -> None:
    runs: list[list[Any]] = []

    @fence.task(lease="tick")
    def tick() -> None:
        runs.append(beat_run(fence.current()))

    beat = take(store, "beat:default", holder="beat@test")
    header = FenceHeader.for_lease(beat, "join").to_message()
    with worker():
        assert wait.finished(run_with_header(tick, header)) == states.SUCCESS
        # The check shares nothing: the lease stays the scheduler's, neither released nor
        # extended.
        owner = store.owner("beat:default")
        assert owner is not None
        assert (owner.holder, owner.state) == ("beat@test", "held")
        assert owner.expires_at == beat.expires_at
        if lease_ends == "released":
            store.release(beat)
        else:
            expire_lease("beat:default")
        late = run_with_header(tick, header)
        assert wait.finished(late) == REJECTED

    assert runs == [["owner", "tick", 1, "beat:default", 1]]
    assert late.info["reason"] == lease_ends
    [stale] = store.stale_runs(lease_name="beat:default")
    assert (stale.reason, stale.stale_epoch, stale.stale_holder) == (lease_ends, 1, "beat@test")
    # Only the first run took the task's lease.
    assert [entry.epoch for entry in store.history("tick")] == [1]


@pytest.mark.parametrize("taken", ["held", "paused"])
def test_a_beat_dispatch_whose_own_lease_is_taken_gets_its_busy_policy(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, taken: str
) -> None:
    """Two slots' runs of one entry do not overlap, and pausing the task's own lease stops the
    runs the beat sends: the dispatch is checked, then the task's lease is refused."""
    ran: list[int] = []

    @fence.task(lease="tick", on_busy="skip")
    def tick() -> None:
        ran.append(1)

    beat = take(store, "beat:default", holder="beat@test")
    earlier = take(store, "tick", holder="tick[earlier-slot]@test")
    if taken == "paused":
        store.pause("tick", reason="incident 42", by="ops@test")
    with worker():
        result = run_with_header(tick, FenceHeader.for_lease(beat, "join").to_message())
        assert wait.finished(result) == SKIPPED

    assert ran == []
    assert (result.info["lease"], result.info["reason"], result.info["owner_epoch"]) == (
        "tick",
        taken,
        earlier.epoch,
    )
    assert store.stale_runs() == []


def superseded_beat(store: LeaseStore) -> dict[str, Any]:
    """The header of a beat epoch another instance has taken over since."""
    beat = take(store, "beat:default", holder="beat@test")
    store.release(beat)
    take(store, "beat:default", holder="beat-2@test")
    return FenceHeader.for_lease(beat, "join").to_message()


def test_a_beat_dispatch_whose_check_is_kept_waiting_gets_its_busy_policy(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, engine: Engine, wait: Wait
) -> None:
    """Recording a stale dispatch can wait (here behind a lock on ``stale_runs``): past the
    lock timeout nothing was decided, and the run is refused as busy, never let through."""
    app.conf.fence_lock_timeout = 0.2
    ran: list[int] = []

    @fence.task(lease="tick")
    def tick() -> None:
        ran.append(1)

    header = superseded_beat(store)
    with worker():
        with engine.begin() as conn:
            conn.exec_driver_sql("LOCK TABLE celery_fence.stale_runs IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            busy = run_with_header(tick, header)
            assert wait.finished(busy) == SKIPPED
            # After fence_lock_timeout (0.2 s), not the default 2 s.
            assert time.monotonic() - started < 1.8
        later = run_with_header(tick, header)
        assert wait.finished(later) == REJECTED

    assert ran == []
    assert (busy.info["lease"], busy.info["reason"]) == ("beat:default", "busy")
    assert fence.store.metrics.get("rejoin.busy") == 1
    [stale] = store.stale_runs()
    assert (stale.lease_name, stale.reason, stale.stale_epoch) == ("beat:default", "superseded", 1)
    assert store.history("tick") == []


def test_shadow_mode_runs_a_beat_dispatch_whose_check_is_kept_waiting_on_its_own_lease(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, engine: Engine, wait: Wait
) -> None:
    app.conf.update(fence_lock_timeout=0.2, fence_enforcement="shadow")

    @fence.task(lease="tick")
    def tick() -> list[Any]:
        return beat_run(fence.current())

    header = superseded_beat(store)
    with worker(), engine.begin() as conn:
        conn.exec_driver_sql("LOCK TABLE celery_fence.stale_runs IN ACCESS EXCLUSIVE MODE")
        outcome = wait.outcome(run_with_header(tick, header))

    assert outcome == ["owner", "tick", 1, "beat:default", 1]
    assert fence.store.metrics.get("shadow.busy") == 1
    assert store.stale_runs() == []


@pytest.mark.parametrize("earlier_run", ["expired", "released", "released meanwhile"])
def test_a_redelivered_beat_dispatch_whose_first_delivery_started_is_not_checked_again(
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    expire_lease: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
    earlier_run: str,
) -> None:
    """The first delivery passed the check and took the task's lease; the beat's leader changed
    since. Its worker lost, the redelivery takes the lease over instead of being rejected; had
    it run to its end (released the lease), before the redelivery looked or between that look
    and its acquisition, the redelivery is dropped: the work is done."""
    runs: list[list[Any]] = []

    @fence.task(lease="tick")
    def tick() -> None:
        runs.append(beat_run(fence.current()))

    task_id = str(uuid.uuid4())
    beat = take(store, "beat:default", holder="beat@test")
    header = FenceHeader.for_lease(beat, "join").to_message()
    first = take(store, "tick", holder=f"{tick.name}[{task_id}]@lost-host")
    if earlier_run == "expired":
        expire_lease("tick")
    elif earlier_run == "released":
        store.release(first)
    else:
        looked = Fence._earlier_delivery

        def look_then_release(self: Fence, *args: Any) -> int | None:
            epoch = looked(self, *args)
            store.release(first)
            return epoch

        monkeypatch.setattr(Fence, "_earlier_delivery", look_then_release)
    store.release(beat)
    take(store, "beat:default", holder="beat-2@test")
    metrics = fence.store.metrics
    with worker():
        result = tick.apply_async(headers={HEADER: header}, task_id=task_id)
        if earlier_run == "expired":
            assert wait.finished(result) == states.SUCCESS
        else:
            wait.until(lambda: metrics.get("busy.duplicate") == 1, what="the redelivery dropped")

    if earlier_run == "expired":
        assert runs == [["owner", "tick", first.epoch + 1, "beat:default", beat.epoch]]
    else:
        assert runs == []
        assert result.state == states.PENDING  # nothing of its own over the first one's result
        # The redelivery took no epoch, or gave back the one it took once it found the work done.
        assert [entry.holder for entry in store.history("tick")][-1] == first.holder
        assert store.owner("tick").state == "released"
    assert store.stale_runs() == []


def test_two_beat_dispatches_with_one_task_id_are_not_each_others_redelivery(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """An entry may give its task a fixed id (its ``task_id`` option): each dispatch carries a
    publication id of its own, so the next slot's run is not taken for a redelivery of the last
    one's and dropped."""
    runs: list[list[Any]] = []

    @fence.task(lease="tick")
    def tick() -> None:
        runs.append(beat_run(fence.current()))

    header = FenceHeader.for_lease(take(store, "beat:default", holder="beat@test"), "join")
    with worker():
        for publication in ("a" * 32, "b" * 32):
            message = {**header.to_message(), "publication": publication}
            result = tick.apply_async(headers={HEADER: message}, task_id="plan-daily")
            assert wait.finished(result) == states.SUCCESS

    assert runs == [
        ["owner", "tick", 1, "beat:default", 1],
        ["owner", "tick", 2, "beat:default", 1],
    ]
    assert fence.store.metrics.get("busy.duplicate") == 0


@pytest.mark.parametrize("case", ["a wait header", "min_hold"])
def test_a_stale_beat_dispatch_is_checked_whatever_its_earlier_delivery_looks_like(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, case: str
) -> None:
    """A wait header is no proof that an earlier delivery was checked, and the lease a min_hold
    run keeps after it ended is no lost delivery: the check is made, and rejects."""
    ran: list[int] = []

    @fence.task(lease="tick", min_hold=60 if case == "min_hold" else 0)
    def tick() -> None:
        ran.append(1)

    task_id = str(uuid.uuid4())
    header = superseded_beat(store)
    headers: dict[str, Any] = {HEADER: header}
    if case == "a wait header":
        headers[WAITING] = {"epoch": 1, "expires_at": datetime.now(timezone.utc).isoformat()}
    else:
        take(store, "tick", holder=f"{tick.name}[{task_id}]@host")  # kept after its run ended
    with worker():
        result = tick.apply_async(headers=headers, task_id=task_id)
        assert wait.finished(result) == REJECTED

    assert ran == []
    assert result.info["reason"] == "superseded"
    [stale] = store.stale_runs()
    assert (stale.lease_name, stale.stale_epoch) == ("beat:default", 1)


def test_a_waiting_retry_of_a_beat_dispatch_whose_earlier_delivery_finished_is_dropped(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """The redelivery was sent to wait for its earlier delivery, which then ran to its end;
    another run took the task's lease since, and the beat's leader changed. The retry leaves
    the earlier delivery's result alone: dropped, not rejected."""
    ran: list[int] = []

    @fence.task(lease="tick")
    def tick() -> None:
        ran.append(1)

    task_id, publication = str(uuid.uuid4()), "c" * 32
    beat = take(store, "beat:default", holder="beat@test")
    header = {**FenceHeader.for_lease(beat, "join").to_message(), "publication": publication}
    first = take(store, "tick", holder=f"{tick.name}[{task_id}]#{publication}@lost-host")
    store.release(first)
    store.release(take(store, "tick", holder="tick[next-slot]@test"))
    store.release(beat)
    take(store, "beat:default", holder="beat-2@test")
    waiting = {"epoch": first.epoch, "expires_at": first.expires_at.isoformat()}
    metrics = fence.store.metrics
    with worker():
        result = tick.apply_async(headers={HEADER: header, WAITING: waiting}, task_id=task_id)
        wait.until(lambda: metrics.get("busy.duplicate") == 1, what="the retry dropped")

    assert ran == []
    assert result.state == states.PENDING
    assert store.stale_runs() == []


@pytest.mark.parametrize("own_lease", ["free", "held"])
def test_shadow_mode_runs_a_beat_dispatch_as_enforcement_would_and_records_what_it_refuses(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, own_lease: str
) -> None:
    """A stale dispatch is recorded and goes on as an accepted one would: on the task's own
    lease, or unfenced when that is held."""
    app.conf.fence_enforcement = "shadow"

    @fence.task(lease="tick")
    def tick() -> list[Any]:
        run = fence.current()
        assert run.dispatched_by is not None
        return [run.mode, run.lease is not None, run.dispatched_by.epoch]

    header = superseded_beat(store)
    if own_lease == "held":
        take(store, "tick", holder="tick[earlier-slot]@test")
    with worker():
        outcome = wait.outcome(run_with_header(tick, header))

    assert outcome == ["owner", own_lease == "free", 1]
    [stale] = store.stale_runs()
    assert (stale.lease_name, stale.reason, stale.enforced) == ("beat:default", "superseded", False)
    assert fence.store.metrics.get("shadow.held") == (own_lease == "held")


def test_enforcement_off_runs_a_beat_dispatch_unchecked_and_names_it(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    app.conf.fence_enforcement = "off"

    @fence.task(lease="tick")
    def tick() -> list[Any]:
        run = fence.current()
        assert run.dispatched_by is not None
        return [run.lease is None, run.dispatched_by.lease, run.dispatched_by.epoch]

    with worker():
        assert wait.outcome(run_with_header(tick, superseded_beat(store))) == [
            True,
            "beat:default",
            1,
        ]

    assert store.stale_runs() == []
    assert store.history("tick") == []


def test_shadow_mode_runs_a_stale_header_and_records_it(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    app.conf.fence_enforcement = "shadow"

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> list[Any]:
        run = fence.current()
        return [run.enforced, run.lease is None]

    old = take(store, holder="old-job@test")
    header = FenceHeader.for_lease(old, "resume").to_message()
    store.release(old)
    take(store)
    with worker():
        assert wait.outcome(run_with_header(publish, header, "prod")) == [False, True]

    [stale] = store.stale_runs(lease_name=NAME)
    assert (stale.reason, stale.stale_epoch, stale.enforced) == ("superseded", 1, False)


def test_a_link_after_a_run_without_a_lease_carries_no_header(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """Shadow mode runs a stale continuation without a lease. What the worker publishes after
    its body (a link) carries no header, as nothing the body publishes does, rather than the
    stale one the run came with, which would be judged and recorded again in every link."""
    app.conf.fence_enforcement = "shadow"
    linked: list[object] = []

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        pass

    @app.task(bind=True)
    def after(self: Task, _: None) -> None:
        linked.append((self.request.headers or {}).get(HEADER, "no header"))

    old = take(store, holder="old-job@test")
    header = FenceHeader.for_lease(old, "resume").to_message()
    store.release(old)
    take(store)
    with worker():
        result = publish.apply_async(("prod",), headers={HEADER: header}, link=after.s())
        wait.finished(result)
        wait.until(lambda: linked, what="the link")

    assert linked == ["no header"]
    [stale] = store.stale_runs(lease_name=NAME)
    assert (stale.reason, stale.stale_epoch, stale.enforced) == ("superseded", 1, False)


@pytest.mark.parametrize("context", ["copied", "not copied"])
def test_a_child_published_from_a_thread_of_the_body_carries_the_header_in_a_copy_of_its_context(
    fence: Fence, worker: StartWorker, wait: Wait, context: str
) -> None:
    """The header comes from the run's context: a thread given a copy of it publishes as the
    body does; one without is outside the run, and its child, on the run's lease, is busy."""

    @fence.task(lease="release:{environment}")
    def parent(environment: str) -> tuple[str, Any]:
        with ThreadPoolExecutor(1) as pool:
            if context == "copied":
                sent = pool.submit(contextvars.copy_context().run, child.delay, environment)
            else:
                sent = pool.submit(child.delay, environment)
            published = sent.result()
        # Holding the lease until the child has its answer.
        wait.until(published.ready, what="the child to end")
        return published.id, fence.current().epoch

    @fence.task(lease="release:{environment}", on_busy="raise")
    def child(environment: str) -> list[Any]:
        run = fence.current()
        return [run.mode, run.epoch]

    with worker(pool="threads", concurrency=2):
        child_id, epoch = wait.outcome(parent.delay("prod"))
        result = child.AsyncResult(child_id)
        if context == "copied":
            assert wait.outcome(result) == ["resume", epoch]
        else:
            assert wait.finished(result) == states.FAILURE
            assert isinstance(result.result, LeaseHeldError)
