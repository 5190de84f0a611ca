"""The document service's tasks: retention planning (sent by beat) and releases (on workers)."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from celery.utils.log import get_task_logger

from celery_fence import ConfigurationError, Lease, StaleEpochError
from celery_fence.store import Executor
from example_app import data
from example_app.celery_app import app, fence

logger = get_task_logger(__name__)

_ENVIRONMENT = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_RELEASE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


class OlderBuildError(Exception):
    """Publishing would replace a newer build, and the release is not a rollback."""


@dataclass(frozen=True, kw_only=True)
class ReleaseRequest:
    """A release's arguments, validated."""

    environment: str
    release_id: str
    commit: str
    build: int
    rollback: bool = False

    @classmethod
    def checked(
        cls, environment: str, release_id: str, commit: str, build: int, rollback: bool = False
    ) -> ReleaseRequest:
        """Raise ``ValueError`` naming the first argument that is not valid."""
        if not isinstance(environment, str) or not _ENVIRONMENT.match(environment):
            raise ValueError(f"environment must be lowercase letters, digits, '-': {environment!r}")
        if not isinstance(release_id, str) or not _RELEASE_ID.match(release_id):
            raise ValueError(f"release id must be letters, digits, '.', '_', '-': {release_id!r}")
        if not isinstance(commit, str) or not _COMMIT.match(commit):
            raise ValueError(f"commit must be 7 to 40 lowercase hex digits: {commit!r}")
        if isinstance(build, bool) or not isinstance(build, int) or build < 1:
            raise ValueError(f"build must be a positive integer: {build!r}")
        if not isinstance(rollback, bool):
            raise ValueError(f"rollback must be true or false: {rollback!r}")
        return cls(
            environment=environment,
            release_id=release_id,
            commit=commit,
            build=build,
            rollback=rollback,
        )


def held_lease() -> Lease:
    """The running task's lease. This app's records name the epoch they were written under,
    and its releases must never let a stale one publish, so it runs enforced only: shadow mode
    may run a task without a lease, and lets a stale write commit."""
    run = fence.current()
    if run.lease is None or not run.enforced:
        raise ConfigurationError("example_app runs with fence_enforcement=enforce only")
    return run.lease


def run_id(task: Any) -> str:
    """The task id, which records key on (a direct call, without one, gets a fresh id)."""
    return str(task.request.id or uuid.uuid4().hex)


@fence.task(lease="retention:planner", purpose="plan retention", bind=True)
def plan_retention(self: Any) -> dict[str, Any]:
    """Plan the removal of the documents past their retention date; delete nothing.

    Each run takes the ``retention:planner`` lease, so that two runs never plan at once; one
    sent by a fenced beat starts only if the scheduler epoch in its headers is still current,
    and its plan records that epoch. The plan commits only while the run's own epoch holds.
    """
    lease = held_lease()
    scheduled = fence.current().dispatched_by
    with fence.guard("write retention plan") as conn:
        plan = data.write_plan(
            conn,
            lease_name=lease.name,
            epoch=lease.epoch,
            holder=lease.holder,
            task_id=run_id(self),
            scheduled_by=None if scheduled is None else scheduled.lease,
            schedule_epoch=None if scheduled is None else scheduled.epoch,
        )
    logger.info(
        "plan %d: %d documents due, planned under %s epoch %d",
        plan.id,
        len(plan.document_ids),
        lease.name,
        lease.epoch,
    )
    return {"plan": plan.id, "epoch": plan.epoch, "document_ids": plan.document_ids}


@fence.task(
    lease="release:{environment}",
    environment="{environment}",
    purpose="release {release_id} build {build}",
    on_busy="retry",
    bind=True,
)
def release(
    self: Any,
    environment: str,
    release_id: str,
    commit: str,
    build: int,
    rollback: bool = False,
    migrate_seconds: float | None = None,
) -> dict[str, Any]:
    """Release a build to an environment: validate, migrate, publish the manifest.

    One release runs per environment at a time (the ``release:{environment}`` lease; a
    second one retries once the first's lease has ended). The manifest is written in a fenced
    transaction: if this run's epoch was superseded meanwhile, for instance because its lease
    expired during a long migration and a newer run took over, the publish is rejected and
    recorded. ``migrate_seconds`` overrides how long the migration takes.
    """
    request = ReleaseRequest.checked(environment, release_id, commit, build, rollback)
    lease = held_lease()
    record = partial(
        data.log_release,
        fence.current().store.engine,
        **asdict(request),
        task_id=run_id(self),
        epoch=lease.epoch,
        holder=lease.holder,
    )
    migrate(
        request, app.conf.example_migrate_seconds if migrate_seconds is None else migrate_seconds
    )
    try:
        with fence.guard(publish_action(request.release_id, request.build)) as conn:
            manifest = publish(conn, request, epoch=lease.epoch)
    except OlderBuildError as exc:
        record(outcome="refused", detail=str(exc))
        raise
    except StaleEpochError as exc:
        record(outcome="rejected", detail=str(exc))
        raise
    record(outcome="published", detail="")
    logger.info(
        "%s now runs %s (build %d), published at epoch %d",
        manifest.environment,
        manifest.release_id,
        manifest.build,
        manifest.epoch,
    )
    return {**asdict(manifest), "published_at": manifest.published_at.isoformat()}


def publish_action(release_id: str, build: int) -> str:
    """The action a release's fenced publish is recorded under, in stale runs too."""
    return f"publish {release_id} build {build}"


def migrate(request: ReleaseRequest, seconds: float) -> None:
    """Stands in for the release's schema migration, which takes ``seconds``."""
    logger.info(
        "release %s: migrating %s for %.1fs", request.release_id, request.environment, seconds
    )
    time.sleep(seconds)


def publish(conn: Executor, request: ReleaseRequest, *, epoch: int) -> data.Manifest:
    """Make the release current, unless it would replace a newer build without ``rollback``
    (then raise :class:`OlderBuildError` and write nothing)."""
    current = data.current_manifest(conn, request.environment)
    if current is not None and request.build < current.build and not request.rollback:
        raise OlderBuildError(
            f"{request.environment} runs build {current.build} ({current.release_id}); "
            f"build {request.build} is older: release it with rollback to roll back"
        )
    return data.put_manifest(conn, **asdict(request), epoch=epoch)
