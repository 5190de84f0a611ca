"""Fenced Celery tasks: one lease per run, acquired at execution time, fenced writes under it."""

from __future__ import annotations

import inspect
import os
import socket
import string
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from functools import cached_property, partial
from typing import Any, Literal, NoReturn

import click
from celery import Celery, Task, bootsteps, current_task, signals
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.log import LoggingProxy

from celery_fence import validation
from celery_fence.exceptions import (
    ConfigurationError,
    FenceError,
    LeaseBusyError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    LeasePausedError,
    StaleEpochError,
)
from celery_fence.keeper import LeaseKeeper
from celery_fence.models import Acquisition, Lease, Owner
from celery_fence.observe import log
from celery_fence.store import Executor, LeaseStore

from .headers import HEADER, FenceHeader, MalformedHeaderError, publication_of, published
from .settings import ON_BUSY, FenceSettings, check_timing

#: Result states a fenced task ends in when it did not run its body.
SKIPPED = "SKIPPED"
REJECTED = "REJECTED"

RunMode = Literal["owner", "resume"]
_current: ContextVar[FencedRun | None] = ContextVar("celery_fence_run", default=None)
_fences: weakref.WeakKeyDictionary[Celery, Fence] = weakref.WeakKeyDictionary()
#: A message header on the retry of a delivery that found an earlier delivery of the same message
#: holding the lease: that delivery's epoch, and the lease's expiry then (see
#: ``FencedTask.refuse``).
WAITING = "celery_fence_waiting"
#: A message header counting the busy retries of a message (``fence_busy_max_retries`` bounds
#: them), apart from the task's own ``request.retries``.
BUSY_RETRIES = "celery_fence_busy_retries"


class FencedRun:
    """One execution of a fenced task: the lease it runs under and how it came by it.

    ``mode`` is ``owner`` (this run acquired the lease) or ``resume`` (a retry or child of a
    fenced run on the same lease, sharing its publisher's epoch or taking the lease over at the
    next one). ``lease`` is ``None`` when the run goes ahead without a lease: in an environment
    whose enforcement is ``off``, or in shadow mode when it would have been refused; its guards
    then let the writes through. ``dispatched_by`` is, for a run of a message a fenced beat
    sent, the beat's header: its lease, epoch and holder.
    """

    def __init__(
        self,
        *,
        store: LeaseStore,
        mode: RunMode,
        enforced: bool,
        lease: Lease | None = None,
        keeper: LeaseKeeper | None = None,
        min_hold: float = 0.0,
    ) -> None:
        self.store = store
        self.mode = mode
        self.enforced = enforced
        self.keeper = keeper
        self.min_hold = min_hold
        self.dispatched_by: FenceHeader | None = None
        #: The entries of other leases the run's header brought, which it passes on.
        self.outer: tuple[FenceHeader, ...] = ()
        self.started = time.monotonic()
        self._lease = lease
        self._refused: StaleEpochError | None = None  # a fenced write's rejection

    @property
    def lease(self) -> Lease | None:
        """The lease as last renewed."""
        return self.keeper.lease if self.keeper is not None else self._lease

    @property
    def epoch(self) -> int | None:
        lease = self.lease
        return None if lease is None else lease.epoch

    @property
    def held(self) -> bool:
        """The cooperative check: false once renewal found the lease lost, a fenced write of the
        run was rejected, or the deadline passed."""
        if self._refused is not None:
            return False
        if self.keeper is not None:
            return self.keeper.held
        return self._lease is not None and self._lease.trusted

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if the lease can no longer be trusted; in shadow mode,
        which blocks nothing, never (``held`` still tells)."""
        lease = self.lease
        if lease is None or self.held or not self.enforced:
            return
        if self._refused is not None:
            raise self._refused
        if self.keeper is not None and self.keeper.error is not None:
            raise self.keeper.error
        raise LeaseLostError(
            f"lease {lease.name} epoch {lease.epoch} passed its deadline",
            lease_name=lease.name,
            epoch=lease.epoch,
            reason="expired",
        )

    @contextmanager
    def guard(self, action: str, conn: Executor | None = None) -> Iterator[Executor]:
        """Fence the writes made in the block (see :meth:`LeaseStore.guard`).

        Without ``conn``, a transaction on the fence database is opened
        (:meth:`LeaseStore.begin`) and yielded; with a SQLAlchemy ``Connection`` or ``Session``
        of your own, its current transaction is fenced.
        """
        lease = self.lease
        try:
            if conn is None:
                with self.store.begin() as own, self._guard(lease, own, action):
                    yield own
            else:
                with self._guard(lease, conn, action):
                    yield conn
        except StaleEpochError as error:
            # Raised by the check, or by the commit of the run's own transaction (a session
            # the server ended for idling past the lease's expiry).
            if lease is not None and (error.lease_name, error.epoch) == (lease.name, lease.epoch):
                self._refused = error
            raise

    @contextmanager
    def _guard(self, lease: Lease | None, conn: Executor, action: str) -> Iterator[None]:
        if lease is None:
            log.info("%r runs unfenced: this run holds no lease", action)
            yield
            return
        with self.store.guard(lease, conn, action=action, enforce=self.enforced):
            yield

    def header(self) -> FenceHeader | None:
        """The header tasks published from this run carry. A run without a lease passes on only
        what it received of other leases, the nearest in the header's own fields: none, if it
        received none."""
        lease = self.lease
        if lease is not None:
            return FenceHeader.for_lease(lease, "resume", self.outer)
        if not self.outer:
            return None
        nearest, *farther = self.outer
        return replace(nearest, outer=tuple(farther))


def current_run() -> FencedRun | None:
    """The fenced run executing in this thread, if any."""
    return _current.get()


def _add_header(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp the fence header on every message published inside a fenced run, and on those the
    worker publishes for a task right after its body (chain links, chord callbacks)."""
    if headers is None:
        return
    run = _current.get()
    value: Mapping[str, Any] | None = None
    if run is not None:
        # Nothing a run publishes waits for an earlier delivery or carries its busy retries, its
        # own retries included.
        headers.pop(WAITING, None)
        headers.pop(BUSY_RETRIES, None)
        header = run.header()
        if header is None:
            # A retry's message copies the request's headers: a run that publishes no header
            # (one without a lease) must not pass on the one it was sent with.
            headers.pop(HEADER, None)
            return
        value = header.to_message()
    elif current_task and HEADER not in headers:
        # A retry of a refused delivery copies the header it came with, publication included:
        # it is the same message, sent again.
        inherited = _header_of(current_task.request)
        if isinstance(inherited, Mapping) and inherited.get("mode") == "resume":
            value = inherited
    if value is not None:
        headers[HEADER] = published(value)


signals.before_task_publish.connect(_add_header, weak=False, dispatch_uid="celery_fence.header")


def refuse_start(what: str, error: FenceError) -> NoReturn:
    """Stop a worker or beat (``what``) from starting with ``error``. Under Celery's command of
    that name (``celery worker``, ``celery beat``, ``app.worker_main()``), as one line and exit
    status 1, as for a mistyped option, instead of a traceback; otherwise (``start_worker``, a
    scheduler made in a test, the beat a worker's ``-B`` starts), as ``error`` itself, for its
    caller."""
    context = click.get_current_context(silent=True)
    if context is None or context.info_name != what:
        raise error
    refusal = click.ClickException(f"{what} not started: {error}")
    if isinstance(sys.stderr, LoggingProxy):
        # A quiet beat (``celery -q``) makes its scheduler once Celery sends stderr to its log
        # (its --logfile, if any): the line goes there, as the rest of its output does.
        log.critical("%s", refusal.format_message())
    else:
        refusal.show()
    # Not an Exception, which a quiet beat would log with a traceback first (it makes the
    # scheduler as its service starts), and which app.worker_main() would hand to its caller.
    raise SystemExit(refusal.exit_code) from error


class FenceWorkerStep(bootsteps.Step):  # type: ignore[misc]
    """Checks the fence settings, every fenced task's timings and the schema at worker start."""

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        try:
            # The worker's own time limit (--time-limit, else task_time_limit) bounds every
            # task that sets none.
            Fence.of(worker.app).check_startup(time_limit=worker.time_limit)
        except FenceError as exc:
            refuse_start("worker", exc)


class Fence:
    """celery-fence for one Celery app: settings, the lease store and the task decorator.

    ``store`` overrides the store built from ``fence_database_url`` (tests pass one with an
    injected clock).
    """

    def __init__(self, app: Celery, *, store: LeaseStore | None = None) -> None:
        self.app = app
        self._store = store
        self._keeper_store: LeaseStore | None = None
        self._settings: FenceSettings | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        _fences[app] = self
        app.steps["worker"].add(FenceWorkerStep)
        signals.worker_process_init.connect(self._after_fork, weak=False)

    @classmethod
    def of(cls, app: Celery) -> Fence:
        """The app's Fence, created on first use."""
        return _fences.get(app) or cls(app)

    # -- configuration ----------------------------------------------------------------------

    @property
    def settings(self) -> FenceSettings:
        if self._settings is None:
            self._settings = FenceSettings.from_conf(self.app.conf, self.app.namespace)
        return self._settings

    @property
    def store(self) -> LeaseStore:
        with self._lock:
            if self._store is None:
                settings = self.settings
                if settings.database_url is None:
                    raise ConfigurationError(
                        "set fence_database_url in the Celery configuration "
                        "(e.g. postgresql://user@host/db)"
                    )
                self._store = LeaseStore.from_url(
                    settings.database_url,
                    max_ttl=settings.max_ttl,
                    lock_timeout=settings.lock_timeout,
                    safety_margin=settings.safety_margin,
                    default_environment=settings.environment,
                )
            return self._store

    @property
    def keeper_store(self) -> LeaseStore:
        """A store on a connection of its own for renewals."""
        store = self.store
        with self._lock:
            if self._keeper_store is None:
                self._keeper_store = store.dedicated()
            return self._keeper_store

    def check_startup(self, *, time_limit: float | None = None) -> None:
        """Validate settings and fenced tasks, and check the schema answers. Called at worker
        start, with the worker's time limit (``time_limit``); raises
        :class:`ConfigurationError` or a database error naming the problem and the database
        (see :meth:`LeaseStore.check_schema`)."""
        settings = self.settings
        # Every fenced task of the app, also one declared on an earlier Fence of it.
        for task in self.app.tasks.values():
            if isinstance(task, FencedTask):
                task.fence_check_timing(settings, time_limit)
        self.store.check_schema()
        log.info(
            "celery-fence ready: environment %s, enforcement %s",
            settings.environment,
            dict(settings.enforcement) or settings.default_enforcement,
        )

    def _after_fork(self, **_: Any) -> None:
        # The solo pool sends worker_process_init without forking: the connections are still
        # this process's own and stay in use.
        if os.getpid() == self._pid:
            return
        self._pid = os.getpid()
        for store in (self._store, self._keeper_store):
            if store is not None:
                store.dispose(close=False)

    # -- the decorator ----------------------------------------------------------------------

    def task(
        self,
        *,
        lease: str,
        environment: str | None = None,
        ttl: float | None = None,
        max_hold: float | None = None,
        min_hold: float | None = 0.0,
        on_busy: str | None = None,
        purpose: str = "",
        renew_interval: float | None = None,
        **options: Any,
    ) -> Callable[[Callable[..., Any]], FencedTask]:
        """Declare a fenced task; ``options`` are Celery's own task options.

        ``lease``, ``environment`` and ``purpose`` are templates filled from the task's
        arguments (``"release:{environment}"``); ``environment`` defaults to
        ``fence_environment``. ``on_busy`` is ``skip``, ``retry`` or ``raise`` (default
        ``fence_on_busy``). ``min_hold`` keeps the lease after the run ends until that many
        seconds after it was acquired (periodic tasks that must not run twice in one period).
        """
        attributes = {
            "fence": self,
            "fence_lease": validation.check_text(
                lease, "lease", max_length=validation.MAX_TEXT_LENGTH
            ),
            # None for fence_environment; an empty template would be taken for none.
            "fence_environment": None
            if environment is None
            else validation.check_text(
                environment, "environment", max_length=validation.MAX_TEXT_LENGTH
            ),
            "fence_ttl": _seconds_or_none(ttl, "ttl", validation.MAX_TTL_SECONDS),
            "fence_max_hold": _seconds_or_none(max_hold, "max_hold", validation.MAX_HOLD_SECONDS),
            # 0 (or None) for none.
            "fence_min_hold": 0.0
            if min_hold is None
            else validation.check_seconds_or_zero(
                min_hold, "min_hold", maximum=validation.MAX_HOLD_SECONDS
            ),
            "fence_on_busy": on_busy,
            "fence_purpose": purpose,
            "fence_renew_interval": _seconds_or_none(
                renew_interval, "renew_interval", validation.MAX_TTL_SECONDS
            ),
        }
        if on_busy is not None:
            validation.check_choice(on_busy, "on_busy", ON_BUSY)
        # A fenced task belongs to this Fence (its app's settings and store): Celery's default,
        # shared=True, would also register it in every app created later, running there under
        # this one's fence.
        options.setdefault("shared", False)
        # Without base=, the app's own task class (its task_cls, such as Django's DjangoTask),
        # as Celery would use.
        base = _fenced_base(options.pop("base", None) or self.app.Task)
        declare: Callable[[Callable[..., Any]], FencedTask] = self.app.task(
            base=base, **attributes, **options
        )
        templates = {"lease": lease, "environment": environment or "", "purpose": purpose}

        def decorator(function: Callable[..., Any]) -> FencedTask:
            _check_templates(templates, function, bound=bool(options.get("bind")))
            return declare(function)

        return decorator

    # -- inside a run -----------------------------------------------------------------------

    def current(self) -> FencedRun:
        """The fenced run executing in this thread; raises :class:`FenceError` outside one."""
        run = _current.get()
        if run is None:
            raise FenceError("no fenced task is running in this thread")
        return run

    @contextmanager
    def guard(self, action: str, conn: Executor | None = None) -> Iterator[Executor]:
        """Shortcut for ``fence.current().guard(action, conn)``."""
        with self.current().guard(action, conn) as executor:
            yield executor

    # -- running ----------------------------------------------------------------------------

    def begin(self, task: FencedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FencedRun:
        """Decide how ``task`` runs: under a new lease, its publisher's epoch, or unfenced. A run
        that holds a lease renews it once :meth:`FencedTask.__call__` starts its keeper."""
        settings = self.settings
        arguments = task.fence_arguments(args, kwargs)
        environment = validation.check_environment(
            _fill(task.fence_environment, arguments, "environment")
            if task.fence_environment
            else settings.environment
        )
        enforcement = settings.enforcement_for(environment)
        value = _header_of(task.request)
        if value is None and task.request.called_directly:
            # Called as a function (celery.starmap and chunks call each item so) inside a fenced
            # run, or inside a task one published: it continues that run, as a task published
            # from there would.
            passed_on: dict[str, Any] = {}
            _add_header(passed_on)
            value = passed_on.get(HEADER)
        received = _readable(value)
        if enforcement == "off" and received is None:
            return FencedRun(store=self.store, mode="owner", enforced=False)
        name = _fill(task.fence_lease, arguments, "lease")
        if enforcement == "off":
            run = FencedRun(store=self.store, mode="owner", enforced=False)
        else:
            run = self._start(task, name, value, arguments, environment, enforcement == "enforce")
        if received is not None:
            run.outer = received.passed_on(name)
        if received is not None and received.mode == "join":
            run.dispatched_by = received
        return run

    def _start(
        self,
        task: FencedTask,
        name: str,
        value: object | None,
        arguments: Mapping[str, Any],
        environment: str,
        enforced: bool,
    ) -> FencedRun:
        if value is not None:
            run = self._continue(task, name, value, arguments, environment, enforced)
            if run is not None:
                return run
        return self._acquire(task, name, arguments, environment, enforced)

    def end(self, run: FencedRun, *, keep: str | None = None) -> None:
        """Stop renewing; release the lease if this run holds it and need not keep it (a
        continuation sharing its publisher's lease only leaves it). With ``keep`` (why: its
        message is requeued, or the run was interrupted) the lease is kept until it expires: a
        released lease would tell the message's redelivery that its work was done. A
        continuation's delivery that shares the lease leaves it unfinished instead."""
        if run.keeper is not None:
            run.keeper.stop()
        lease = run.lease
        if lease is None:
            return
        if keep is not None and lease.sharer is not None:
            # A continuation's share: its join, left unfinished, tells the message's redelivery
            # to join in its place, so the lease need not run out first.
            log.info(
                "leaving lease %s unfinished: %s",
                lease.name,
                keep,
                extra={"lease": lease.name, "epoch": lease.epoch},
            )
            self._release(lease, enforced=run.enforced, finished=False)
            return
        if keep is not None:
            log.info(
                "keeping lease %s until it expires: %s",
                lease.name,
                keep,
                extra={"lease": lease.name, "epoch": lease.epoch},
            )
            return
        if run.min_hold > 0 and time.monotonic() - run.started < run.min_hold:
            log.info(
                "keeping lease %s until its minimum hold of %gs has passed",
                lease.name,
                run.min_hold,
                extra={"lease": lease.name, "epoch": lease.epoch},
            )
            return
        self._release(lease, enforced=run.enforced)

    def _release(self, lease: Lease, *, enforced: bool, finished: bool = True) -> None:
        """Release ``lease`` at the end of a run; a release that fails leaves it to expire, and
        so does one something else stops (a soft time limit that fires as the run ends): the run
        ends as its body did, and the log says why the lease was not given back."""
        try:
            self.store.release(lease, enforce=enforced, finished=finished)
        except LeaseLostError:
            pass  # already logged, counted and recorded by the store
        except Exception as exc:
            log.warning(
                "could not release lease %s (it will expire): %s",
                lease.name,
                str(exc) or repr(exc),
                exc_info=not isinstance(exc, FenceError),
                extra={"lease": lease.name, "epoch": lease.epoch},
            )

    def _acquire(
        self,
        task: FencedTask,
        name: str,
        arguments: Mapping[str, Any],
        environment: str,
        enforced: bool,
        since: int | None = None,
    ) -> FencedRun:
        """Take the task's lease for this run. ``since``: the epoch of it an earlier delivery of
        this message took, when known other than by the ``WAITING`` header."""
        settings = self.settings
        if task.request.called_directly or task.request.is_eager:
            # No worker checked this task's timings when it started (check_startup): the errors
            # name the option, not the TTL the store would refuse.
            task.fence_check_timing(settings)
        ttl = task.fence_lease_ttl(settings)
        interval = task.fence_renewal_period(settings, ttl)
        if since is None and task.fence_waited_for() is None and task.fence_redelivered():
            # The broker delivers the message again (acks_late after a lost worker or a lost
            # acknowledgement, a visibility timeout): an earlier delivery that took the lease's
            # latest epoch may have run to its end.
            since = self._earlier_delivery(task, name)
        done = self._done_before(task, name, enforced, "owner", since)
        if done is not None:
            return done
        try:
            got = self.store.acquire(
                name,
                holder=task.fence_holder(),
                ttl=task.fence_acquisition_ttl(settings),
                environment=environment,
                max_hold=task.fence_max_hold or settings.max_hold,
                purpose=_fill(task.fence_purpose, arguments, "purpose"),
            )
        except LeasePausedError as exc:
            got = Acquisition(outcome="paused", lease=None, owner=exc.owner)
        lease = got.lease
        if lease is None:
            return self._refused(task, name, got, enforced, "owner")
        # By the TTL, also after an acquisition for min_hold: renewals keep the lease while the
        # run goes on, and never past min_hold after it was taken once the run ends.
        renew = partial(self.keeper_store.renew, ttl=ttl, enforce=enforced)
        try:
            # The earlier delivery this one waited for may have run to its end between the look
            # above and this acquisition: then the work is done.
            finished = task.fence_finished_before(name, lease.epoch, since)
        except BaseException:
            # A run that cannot go on does not keep the lease until it expires.
            self._release(lease, enforced=enforced)
            raise
        if finished:
            self._release(lease, enforced=enforced)
            got = Acquisition(outcome="held", lease=None, owner=self.store.owner(name))
            return self._refused(task, name, got, enforced, "owner", done=True)
        return FencedRun(
            store=self.store,
            mode="owner",
            enforced=enforced,
            keeper=LeaseKeeper(lease, renew, interval=interval),
            min_hold=task.fence_min_hold,
        )

    def _done_before(
        self, task: FencedTask, name: str, enforced: bool, mode: RunMode, since: int | None = None
    ) -> FencedRun | None:
        """The refused run of a delivery that waited for an earlier delivery of its message to
        end (or found it had taken the lease at epoch ``since``), when that one ran to its end
        and released the lease: it did the work, which must not run twice. ``None`` for any
        other delivery."""
        if since is None and task.fence_waited_for() is None:
            return None
        owner = self.store.owner(name)
        if owner is None or not task.fence_finished_before(name, owner.epoch, since):
            return None
        done = Acquisition(outcome="held", lease=None, owner=owner)
        return self._refused(task, name, done, enforced, mode, done=True)

    def _refused(
        self,
        task: FencedTask,
        name: str,
        got: Acquisition,
        enforced: bool,
        mode: RunMode,
        *,
        done: bool = False,
    ) -> FencedRun:
        """A run the lease was refused to: the task's busy policy applies (``done``: an earlier
        delivery of its message ran to its end, see :meth:`FencedTask.refuse`), or, in shadow
        mode, the run goes ahead unfenced, logged and counted."""
        if enforced:
            # A busy answer with no owner: a lock on the whole lease table (a VACUUM FULL, a
            # migration) kept the call and the owner's read waiting.
            unknown = got.outcome == "busy" and got.owner is None
            task.fence_refuse(
                name, got, done=done, holder_unknown=unknown, continuation=mode == "resume"
            )
        self._would_refuse(task, name, got)
        return FencedRun(store=self.store, mode=mode, enforced=False)

    def _would_refuse(self, task: FencedTask, name: str, got: Acquisition) -> None:
        """Log and count what shadow mode lets through."""
        log.warning(
            "shadow mode: %s would have been refused lease %s (%s); running anyway",
            task.name,
            name,
            got.outcome,
            extra={"lease": name, "outcome": got.outcome},
        )
        self.store.metrics.incr(f"shadow.{got.outcome}")

    def _earlier_delivery(self, task: FencedTask, name: str) -> int | None:
        """The epoch of the task's lease ``name`` an earlier delivery of this message took, when
        that is the lease's latest epoch (held, expired or released)."""
        if task.fence_delivery_prefix() is None:
            return None
        owner = self.store.owner(name)
        return (
            owner.epoch
            if owner is not None and task.fence_owned_by_an_earlier_delivery(owner)
            else None
        )

    def _continue(
        self,
        task: FencedTask,
        name: str,
        value: object,
        arguments: Mapping[str, Any],
        environment: str,
        enforced: bool,
    ) -> FencedRun | None:
        """Run under the header's epoch (a retry or child of a run on this task's own lease,
        ``resume``), or, for a beat dispatch (``join``), check that the scheduler's epoch is still
        current and take the task's own lease. ``None`` for a header that carries no entry of
        the task's lease, which the task does not continue: it takes its own lease instead."""
        action = f"start {task.name}"
        try:
            header = FenceHeader.from_message(value)
        except MalformedHeaderError as exc:
            self.store.record_stale_run(
                exc.lease_name or "(unreadable)",
                epoch=None,
                holder=exc.holder or "(unreadable)",
                reason="malformed",
                action=action,
                environment=environment,
                enforced=enforced,
            )
            error = LeaseLostError(
                str(exc), lease_name=exc.lease_name or "(unreadable)", reason="malformed"
            )
            return (
                task.fence_reject(error)
                if enforced
                else FencedRun(store=self.store, mode="resume", enforced=False)
            )
        ttl = task.fence_lease_ttl(self.settings)
        if header.mode == "resume":
            entry = header.entry_for(name)
            if entry is None:
                return None
            # The run continues under its own lease's entry: the header's, or an outer one (a
            # chain link after a step on another lease).
            header = entry
            # Before the lease is taken up: a run that cannot renew it fails first.
            interval = task.fence_renewal_period(self.settings, ttl)
            done = self._done_before(task, header.lease, enforced, "resume")
            if done is not None:
                return done
        else:
            # The retry of a delivery that waited for an earlier one of its message, which has
            # run to its end since: the work is done, whoever took the lease after it.
            done = self._done_before(task, name, enforced, "owner")
            if done is not None:
                return done
            since = self._earlier_delivery(task, name)
            if since is not None:
                # An earlier delivery of this very message passed the check and took the task's
                # lease, its latest epoch (its worker was lost, or the broker's visibility timeout
                # passed): the dispatch was checked. This one waits for that delivery, takes over
                # from it, or is dropped once it ran to its end.
                return self._acquire(task, name, arguments, environment, enforced, since)
        try:
            got = self.store.rejoin(
                header.lease,
                epoch=header.epoch,
                holder=header.holder,
                mode=header.mode,
                proof=header.proof,
                ttl=ttl,
                action=action,
                enforce=enforced,
                environment=environment,
                # A take-over goes on in this run's name, so that a redelivery of this message
                # finds it its own earlier delivery's and waits for it (see FencedTask.refuse).
                successor=task.fence_holder(),
                delivery_prefix=task.fence_delivery_prefix(),
            )
        except LeaseLostError as exc:
            if enforced:
                task.fence_reject(exc)
            if header.mode == "resume":
                return FencedRun(store=self.store, mode="resume", enforced=False)
            # Shadow mode: a stale dispatch goes on as an accepted one would, on the task's lease.
            return self._acquire(task, name, arguments, environment, enforced)
        if header.mode == "join":
            if got.outcome != "joined":
                # The check waited past lock_timeout (the stale run it found could not be
                # recorded, behind a lock on stale_runs): nothing is recorded, and the busy
                # policy applies; in shadow mode the run goes on as below.
                if enforced:
                    # Retried soon (on_busy="retry"): it waited for a lock, not for the beat's
                    # lease to end.
                    task.fence_refuse(header.lease, replace(got, owner=None))
                self._would_refuse(task, header.lease, got)
            # The dispatch was the current leader's: the run is the task's own from here on, on
            # its lease, so that a change of leader does not reach it and two runs of one entry
            # do not overlap.
            return self._acquire(task, name, arguments, environment, enforced)
        if got.lease is None:
            # A resume kept waiting past lock_timeout by fenced writers, or one whose lease an
            # earlier delivery of its message took over and holds, or joined and shares ("shared")
            # or joined and left, its work done ("done").
            return self._refused(
                task, header.lease, got, enforced, "resume", done=got.outcome == "done"
            )
        # A continuation that joined a held lease is one more sharer: releasing it only leaves;
        # the lease is released when its last sharer releases it.
        renew = partial(self.keeper_store.renew, enforce=enforced)
        return FencedRun(
            store=self.store,
            mode="resume",
            enforced=enforced,
            keeper=LeaseKeeper(got.lease, renew, interval=interval),
        )


class FencedTask(Task):  # type: ignore[misc]
    """Base class of tasks declared with :meth:`Fence.task`."""

    fence: Fence
    fence_lease: str
    fence_environment: str | None = None
    fence_ttl: float | None = None
    fence_max_hold: float | None = None
    fence_min_hold: float = 0.0
    fence_on_busy: str | None = None
    fence_purpose: str = ""
    fence_renew_interval: float | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        enclosing = _current.get()
        run = self.fence.begin(self, args, kwargs)
        token = _current.set(run)
        keep = None
        try:
            # Renewals start here, where whatever stops the run (a soft time limit, a pool
            # process's SystemExit) reaches the end below, which stops them.
            if run.keeper is not None:
                run.keeper.start()
            return super().__call__(*args, **kwargs)
        except Reject as exc:
            if exc.requeue and self._fence_may_come_back():
                keep = "the message is requeued"
            raise
        except BaseException as exc:
            if self.fence_stopped_by(exc):
                # The work may be unfinished, and the message may come back.
                keep = f"the run was interrupted ({type(exc).__name__})"
            raise
        finally:
            _current.reset(token)
            header = run.header()
            self.fence.end(run, keep=keep)
            # What the worker publishes after the body (the next link of a chain, a chord
            # callback) runs at this epoch too; after a run without a lease, without the header
            # the message came with, as what the body published. Not for a run inside another:
            # what is published there carries that run's header, and a task calling itself is
            # given the request of the body it is called in, which its next call would read.
            request = self.request
            if enclosing is None and not request.called_directly:
                setattr(request, HEADER, _NO_HEADER if header is None else header.to_message())
            elif enclosing is None and run.mode == "resume" and header is not None:
                # Called as a function in a task published from a fenced run (each item of a
                # starmap or chunks), which it continued: the next item continues from this
                # one's epoch, which may have taken the lease over from the one it came with.
                caller = current_task.request if current_task else None
                if caller is not None and not caller.called_directly:
                    setattr(caller, HEADER, header.to_message())

    def fence_stopped_by(self, exc: BaseException) -> bool:
        """Whether ``exc`` stopped this run in the middle (a prefork child's SIGTERM handler
        raises SystemExit in the body: not an ``Exception``) with a message that may come
        back."""
        return not isinstance(exc, Exception) and self._fence_may_come_back()

    def _fence_may_come_back(self) -> bool:
        """Whether this run's message can be delivered again: one acknowledged late, not one
        acknowledged when it arrived, nor a call with no message (direct, or eager)."""
        request = self.request
        return bool(self.acks_late) and not (request.called_directly or request.is_eager)

    def apply(
        self,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        *rest: Any,
        headers: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Run the task here and now (``task_always_eager`` too): from inside a fenced run, with
        the header a message published there would carry, so that it continues the run as it
        would on a worker."""
        headers = dict(headers or {})
        _add_header(headers)
        return super().apply(args, kwargs, *rest, headers=headers, **options)

    def fence_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The run's arguments by parameter name, defaults included (for the templates)."""
        try:
            bound = self._fence_signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"{self.name}: {exc}") from exc
        bound.apply_defaults()
        return dict(bound.arguments)

    @cached_property
    def _fence_signature(self) -> inspect.Signature:
        return inspect.signature(self.run)

    def fence_holder(self) -> str:
        request = self.request
        host = request.hostname or socket.gethostname()
        return f"{self._fence_run_name()}@{host}"[: validation.MAX_NAME_LENGTH]

    def _fence_run_name(self) -> str:
        """The task and its id, and for a message published from a fenced run the publication
        id its header carries: retries share the task id, not the publication."""
        publication = publication_of((self.request.headers or {}).get(HEADER))
        suffix = "" if publication is None else f"#{publication}"
        return f"{self.name}[{self.request.id or 'direct'}]{suffix}"

    def fence_delivery_prefix(self) -> str | None:
        """How the holder of every delivery of this very message begins (the same task id, on
        any host); ``None`` for a direct call, and for a task name and id too long for a holder
        to keep whole, which would name other messages' runs too."""
        if self.request.called_directly or self.request.id is None:
            return None
        prefix = f"{self._fence_run_name()}@"
        return prefix if len(prefix) <= validation.MAX_NAME_LENGTH else None

    def fence_earlier_delivery(self, holder: str) -> bool:
        """Whether ``holder`` names a run of this very message, as a redelivery finds it: with
        ``acks_late``, after a worker was lost, or after the broker's visibility timeout while
        that run goes on."""
        prefix = self.fence_delivery_prefix()
        return prefix is not None and holder.startswith(prefix)

    def fence_finished_before(self, name: str, epoch: int, since: int | None = None) -> bool:
        """Whether this delivery waited for an earlier delivery of its message (see
        :meth:`waited_for`; ``since``, the epoch that delivery took, when known otherwise) that
        ran to its end: an epoch of the lease from the one it waited for on (``epoch`` is the
        lease's now) ended released, held by a run of this message. A pause since, or other
        messages' epochs after it, do not hide it."""
        waited = since if since is not None else self.fence_waited_for()
        prefix = self.fence_delivery_prefix()
        if waited is None or prefix is None or epoch < waited:
            return False
        return self.fence.store.released_by(name, since_epoch=waited, holder_prefix=prefix)

    def fence_redelivered(self) -> bool:
        """Whether the broker flags this delivery as one of a message it delivered before."""
        return bool((self.request.delivery_info or {}).get("redelivered"))

    def fence_waited_for(self) -> int | None:
        """The epoch of the earlier delivery's lease this delivery was retried to wait for (the
        ``WAITING`` header), if any."""
        value = (self.request.headers or {}).get(WAITING)
        epoch = value.get("epoch") if isinstance(value, Mapping) else None
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 1:
            return epoch
        return None

    def fence_owned_by_an_earlier_delivery(self, owner: Owner | None) -> bool:
        """Whether the lease's latest epoch (``owner``) is an earlier delivery's of this
        message, whose run may be gone: the lease tells once it expires. Not for a task with
        ``min_hold``, whose lease is kept on purpose after a finished run."""
        return (
            owner is not None
            and not self.fence_min_hold
            and self.fence_earlier_delivery(owner.holder)
        )

    def _fence_held_by_an_earlier_delivery(self, got: Acquisition, *, continuation: bool) -> bool:
        """Whether the refused lease is held by an earlier delivery of this message, or by its
        publisher and shared with an earlier delivery that joined it (``"shared"``). A
        continuation's earlier delivery that took its lease over releases it when its run ends,
        also for a task with ``min_hold``."""
        owner = got.owner
        if owner is None or not owner.held:
            return False
        if got.outcome == "shared":
            return True
        return got.outcome == "held" and (
            self.fence_earlier_delivery(owner.holder)
            if continuation
            else self.fence_owned_by_an_earlier_delivery(owner)
        )

    def fence_lease_ttl(self, settings: FenceSettings) -> float:
        """The TTL of the task's lease, its own or the default: what renewals extend it by, for
        a run and for its retries and children."""
        return self.fence_ttl or settings.default_ttl

    def fence_acquisition_ttl(self, settings: FenceSettings) -> float:
        """What a run that takes the lease asks for: its TTL, or its ``min_hold`` if longer, so
        that the lease is kept that long from when it was taken."""
        return max(self.fence_lease_ttl(settings), self.fence_min_hold)

    def fence_renewal_period(self, settings: FenceSettings, ttl: float) -> float:
        """The task's renew interval, checked against ``ttl``; errors name where each came from:
        the task's option or the app's setting."""
        return check_timing(
            ttl,
            self.fence_renew_interval or settings.renew_interval,
            settings.safety_margin,
            ttl_name=f"{self.name} ttl" if self.fence_ttl else "fence_default_ttl",
            interval_name=(
                f"{self.name} renew_interval"
                if self.fence_renew_interval
                else "fence_renew_interval"
            ),
        )

    def fence_check_timing(self, settings: FenceSettings, time_limit: float | None = None) -> None:
        """Reject timings that cannot work: a TTL above the maximum or above the maximum hold,
        a renew interval that cannot keep the lease, a time limit longer than the maximum hold
        (without one, the bound the database puts on every lease). The task's time limit is
        its own, else ``time_limit`` (the worker's), else ``task_time_limit``."""
        ttl = validation.check_seconds(
            self.fence_lease_ttl(settings),
            f"{self.name} ttl",
            maximum=settings.max_ttl,
            limit="fence_max_ttl",
        )
        self.fence_renewal_period(settings, ttl)
        taken_for = validation.check_seconds(
            self.fence_acquisition_ttl(settings),
            f"{self.name} min_hold",
            maximum=settings.max_ttl,
            limit="fence_max_ttl",
        )
        max_hold = self.fence_max_hold or settings.max_hold
        if max_hold is None:
            hold = max(taken_for, validation.DEFAULT_MAX_HOLD_SECONDS)
        else:
            # The store refuses an acquisition whose ttl (the larger of the task's ttl and its
            # min_hold) exceeds its maximum hold: every run would fail.
            hold = validation.check_max_hold(
                max_hold,
                taken_for,
                what=f"{self.name} max_hold"
                if self.fence_max_hold
                else f"{self.name}: fence_max_hold",
                ttl_what="its min_hold"
                if self.fence_min_hold > self.fence_lease_ttl(settings)
                else "the lease's ttl",
            )
        time_limit = self.time_limit or time_limit or self.app.conf.task_time_limit
        if time_limit is not None and time_limit > hold:
            bound = "" if max_hold is not None else " (the longer of its ttl and a day)"
            raise ConfigurationError(
                f"{self.name}: time limit {time_limit:g}s exceeds the lease's maximum hold "
                f"{hold:g}s{bound}, so the lease would end before the task could"
            )

    def fence_refuse(
        self,
        name: str,
        got: Acquisition,
        *,
        done: bool = False,
        holder_unknown: bool = False,
        continuation: bool = False,
    ) -> NoReturn:
        """Apply the busy policy to a refused acquisition, or a continuation's refused resume
        (``continuation``): skip, retry or raise. A redelivery whose earlier delivery holds the
        lease waits for it whatever the policy, and is dropped once that delivery ran to its end
        (``done``, as :meth:`finished_before` found). A run that cannot tell whether anyone holds
        the lease (``holder_unknown``) is not skipped but retried."""
        owner = got.owner
        policy = self.fence_on_busy or self.fence.settings.on_busy
        until = owner.expires_at.isoformat() if owner else "unknown"
        who = f"{owner.holder} (epoch {owner.epoch})" if owner else "unknown"
        reason = got.outcome
        if reason == "paused" and owner is not None:
            message = (
                f"{self.name}: lease {name} is paused by {owner.paused_by}: {owner.paused_reason}"
            )
            # A lease paused before anyone held it has no holder to name.
            if owner.epoch > 0:
                message += f"; last held by {who}"
        elif reason == "busy":
            holder = f"{who}, {owner.state}" if owner else "unknown"
            message = (
                f"{self.name}: lease {name} is busy: the call waited past lock_timeout for a "
                f"lock held by fenced writers or other acquirers (holder {holder})"
            )
        else:
            message = f"{self.name}: lease {name} is held by {who} until {until}"
        error_cls = {"paused": LeasePausedError, "busy": LeaseBusyError}.get(reason, LeaseHeldError)
        error = error_cls(message, lease_name=name, owner=owner, reason=reason)
        holding = _current.get()
        held = None if holding is None else holding.lease
        if (
            held is not None
            and owner is not None
            and (held.name, held.epoch) == (name, owner.epoch)
        ):
            # Called inside the very run that holds the lease (a task calling itself, which
            # Celery gives that run's request): refused, whatever the policy; a retry would only
            # end the run it was called in.
            raise error
        if done:
            # That delivery did the work and stored its result under this same task id: this
            # one ends without a state, which would overwrite it.
            self.fence.store.metrics.incr("busy.duplicate")
            log.info(
                "%s: an earlier delivery of this message ran to its end under lease %s; this "
                "delivery is dropped",
                self.name,
                name,
                extra={"lease": name},
            )
            raise Ignore(f"{self.name}: an earlier delivery of this message ran to its end")
        # Called directly or eagerly (apply()), a retry would run again at once, not at the
        # owner's expiry: such a run fails instead.
        retries = not (self.request.called_directly or self.request.is_eager)
        if retries and self._fence_held_by_an_earlier_delivery(got, continuation=continuation):
            # Skipping would acknowledge the only message left of work whose run may be gone:
            # wait for that run's lease to end, for as long as it holds it (never past its
            # maximum hold), without using up the busy retries.
            assert owner is not None
            self.fence.store.metrics.incr("busy.wait")
            waiting = {"epoch": owner.epoch, "expires_at": owner.expires_at.isoformat()}
            whose = "shared with " if got.outcome == "shared" else ""
            self._fence_retry_busy(
                f"{message} ({whose}an earlier delivery of this message)",
                error,
                got.expires_in,
                {WAITING: waiting},
            )
        if holder_unknown and policy == "skip" and retries:
            policy = "retry"  # a second later: there is no owner's expiry to wait for
        busy_retries = self._fence_busy_retries() + 1
        if policy == "retry" and (
            not retries or busy_retries > self.fence.settings.busy_max_retries
        ):
            policy = "raise"  # called directly or eagerly, or past fence_busy_max_retries
        if policy == "skip" and not retries:
            # Called directly or eagerly, the caller learns it from the error: an eager chord
            # would call its body with a skipped part's None.
            policy = "raise"
        self.fence.store.metrics.incr(f"busy.{policy}")
        if policy == "retry":
            self._fence_retry_busy(message, error, got.expires_in, {BUSY_RETRIES: busy_retries})
        if policy == "raise":
            log.info(message, extra={"lease": name})
            raise error
        log.info("%s; skipped", message, extra={"lease": name})
        self._fence_stop(SKIPPED, error)

    def _fence_busy_retries(self) -> int:
        """The busy retries this message had so far (its ``BUSY_RETRIES`` header)."""
        value = (self.request.headers or {}).get(BUSY_RETRIES)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        return 0

    def _fence_retry_busy(
        self,
        message: str,
        error: LeaseError,
        expires_in: float | None,
        headers: Mapping[str, Any],
    ) -> NoReturn:
        """Send this message again at the owner's expiry, ``expires_in`` seconds away by the
        database clock (1 s for a paused lease, or when the answer did not tell), with
        ``headers`` added, and end this delivery in ``RETRY``, as ``Task.retry`` would, but
        without counting a retry of the task's own: ``request.retries`` and ``max_retries``
        are the task's."""
        settings = self.fence.settings
        owner = error.owner
        countdown = 1.0
        if owner is not None and not owner.paused and expires_in is not None:
            countdown = min(max(expires_in, 0.5), settings.max_ttl)
        log.info("%s; retrying in %.1fs", message, countdown, extra={"lease": error.lease_name})
        request = self.request
        signature = self.signature_from_request(
            request,
            countdown=countdown,
            headers={**(request.as_execution_options()["headers"] or {}), **headers},
        )
        try:
            signature.apply_async()
        except Exception as exc:
            # As Task.retry: a message that cannot be sent again is rejected, not lost in a
            # state that says it was.
            raise Reject(exc, requeue=False) from exc
        raise Retry(message, exc=error, when=countdown, sig=signature)

    def fence_reject(self, error: LeaseLostError) -> NoReturn:
        """End a continuation whose epoch no longer holds before its body runs: called directly
        or eagerly, with the error, as a skip."""
        if self.request.called_directly or self.request.is_eager:
            raise error
        self._fence_stop(REJECTED, error)

    def _fence_stop(self, state: str, error: LeaseError) -> NoReturn:
        if _awaited_by_a_chord(self.request):
            # A chord calls its body once every part has ended in a state Celery counts as
            # finished, which SKIPPED and REJECTED are not: the chord would wait forever. A
            # part fails with the error instead (with the links of its chain, which Celery
            # marks failed too), and the chord with a ChordError naming it.
            self.backend.mark_as_failure(self.request.id, error, request=self.request)
            raise Ignore(str(error))
        owner = error.owner
        meta = {
            "lease": error.lease_name,
            "reason": error.reason,
            "message": str(error),
            "epoch": error.epoch,
            "owner_holder": owner.holder if owner else None,
            "owner_epoch": owner.epoch if owner else None,
            "owner_expires_at": owner.expires_at.isoformat() if owner else None,
        }
        self.update_state(state=state, meta=meta)
        # The links of a chain after this task never run: each ends as this one did, as Celery
        # ends them after a failure, so that the chain's result (its last link) says why. A
        # chord's result is its body's, which its own chain, if any, follows.
        links = list(self.request.chain or ())
        while links:
            link = Context(links.pop())
            link.update(link.options)
            link.id = link.options.get("task_id")
            link.group = link.options.get("group_id")
            if link.id is not None:
                self.backend.store_result(link.id, meta, state, request=link)
            if link.subtask_type == "chord" and (link.kwargs or {}).get("body") is not None:
                links.insert(0, link.kwargs["body"])
        raise Ignore(str(error))


def _seconds_or_none(value: object, what: str, maximum: float) -> float | None:
    """A task option's seconds, checked when the task is declared; ``None`` when not given (the
    setting applies)."""
    return None if value is None else validation.check_seconds(value, what, maximum=maximum)


def _awaited_by_a_chord(request: Any) -> bool:
    """Whether a chord waits for this task: as one of its parts, or for the end of the chain
    this task starts, one of whose links is a part."""
    if request.chord:
        return True
    return any(
        isinstance(link, Mapping) and bool((link.get("options") or {}).get("chord"))
        for link in request.chain or ()
    )


def _fenced_base(base: object) -> type[FencedTask]:
    """The class of a fenced task whose base (Celery's ``base=``, else the app's task class) is
    ``base``: one deriving from both :class:`FencedTask` and that base, so that the fence wraps
    what the base adds."""
    if not isinstance(base, type) or not issubclass(base, Task):
        raise ConfigurationError(f"base must be a subclass of celery.Task, got {base!r}")
    if issubclass(base, FencedTask):
        return base
    # Named after both, and placed here: the app's task class is named Task, in celery.app.task.
    name = f"FencedTask[{base.__module__}.{base.__qualname__}]"
    return type(name, (FencedTask, base), {"__module__": __name__, "__qualname__": name})


def _check_templates(
    templates: Mapping[str, str], function: Callable[..., Any], *, bound: bool
) -> None:
    """Refuse, at declaration, a template field that names no parameter of the task's body
    (its first, the task itself, left out under ``bind=True``): every run would fail. A
    ``**kwargs`` parameter is one name too (``{kwargs[region]}``). What an argument holds (its
    items and attributes) is known only when the run fills it."""
    parameters = list(inspect.signature(function).parameters)[1 if bound else 0 :]
    for what, template in templates.items():
        if not isinstance(template, str):
            raise ConfigurationError(f"the {what} template must be a string, got {template!r}")
        try:
            fields = _template_fields(template)
        except ValueError as exc:
            raise ConfigurationError(
                f"the {what} template {template!r} is malformed: {exc}"
            ) from exc
        for name in fields:
            if not isinstance(name, str) or not name:
                named = ", ".join(f"{{{parameter}}}" for parameter in parameters) or "none"
                raise ConfigurationError(
                    f"the {what} template {template!r} must name the task's parameters "
                    f"({named}), not their positions"
                )
            if name not in parameters:
                raise ConfigurationError(
                    f"the {what} template {template!r} names {name!r}, which is not a "
                    f"parameter of {function.__qualname__} ({', '.join(parameters) or 'none'})"
                )


class _Anything:
    """Whatever a field's attributes and items turn out to be."""

    def __getattr__(self, name: str) -> _Anything:
        return self

    def __getitem__(self, key: object) -> _Anything:
        return self


class _FieldNames(string.Formatter):
    """Reads a field as ``str.format`` would, on arguments that have every attribute and item:
    its name, or ``ValueError`` for a field no arguments could fill."""

    def get_value(self, key: int | str, args: Any, kwargs: Any) -> _Anything:
        return _Anything()


_FIELD_NAMES = _FieldNames()


def _template_fields(template: str) -> list[int | str]:
    """The names the fields of a format string start with (an int for a position), those
    nested in its format specs included. ``ValueError`` for what ``str.format`` would refuse
    whatever the arguments: an unknown conversion, a malformed field name."""
    fields: list[int | str] = []
    for _, field, spec, conversion in string.Formatter().parse(template):
        if field is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            raise ValueError(f"unknown conversion !{conversion}")
        fields.append(_FIELD_NAMES.get_field(field, (), {})[1])
        fields.extend(_template_fields(spec or ""))
    return fields


def _fill(template: str, arguments: Mapping[str, Any], what: str) -> str:
    try:
        return template.format_map(arguments)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise ConfigurationError(
            f"cannot fill the {what} template {template!r} from the task's arguments: {exc!r}"
        ) from exc


def _readable(value: object | None) -> FenceHeader | None:
    """The header ``value``, when there is one and it is well formed."""
    if value is None:
        return None
    try:
        return FenceHeader.from_message(value)
    except MalformedHeaderError:
        return None


#: What a run without a lease leaves as its request's header (see :func:`_header_of`).
_NO_HEADER = object()


def _header_of(request: Any) -> object | None:
    """The request's header: the one its run set after the body (see ``FencedTask.__call__``),
    or none after a run without a lease, over the one the message brought, which Celery also
    keeps in ``request.headers``."""
    value: object | None = getattr(request, HEADER, None)
    if value is _NO_HEADER:
        return None
    if value is not None:
        return value
    headers = getattr(request, "headers", None) or {}
    return headers.get(HEADER)


__all__ = ["REJECTED", "SKIPPED", "Fence", "FencedRun", "FencedTask", "current_run"]
