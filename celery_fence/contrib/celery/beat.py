"""FencedScheduler: a celery beat scheduler that any number of instances can run at once.

    celery -A proj beat -S fence

One leader lease per schedule (``fence_beat_lease``, default ``scheduler:<app name>``). Only the
holder dispatches; it renews on its tick and trusts the lease only until its monotonic
deadline. On loss it steps down to standby (no crash, no restart loop) and a standby takes over
within about one TTL. Every dispatched task carries the scheduler's epoch in its headers (a
fenced task starts only while it is current), and each schedule slot is claimed in a fenced
transaction, so a slot is dispatched at most once even if two instances believe they lead.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import schedules
from celery.beat import ScheduleEntry, Scheduler
from celery.utils.time import maybe_make_aware

from celery_fence import validation
from celery_fence.exceptions import (
    ConfigurationError,
    FenceDatabaseError,
    LeaseLostError,
    LeasePausedError,
    SchemaNotInstalledError,
)
from celery_fence.keeper import retry_after_failure
from celery_fence.models import Dispatch, Lease, Owner
from celery_fence.observe import log

from .fence import Fence, refuse_start
from .headers import HEADER, FenceHeader, published


def slot_of(entry: ScheduleEntry, now: datetime) -> datetime:
    """The slot a due entry fires for, the same on every instance: interval schedules in
    buckets of their period counted from the Unix epoch, crontabs by their latest occurrence at
    or before ``now`` (also when sent late), anything else by the second."""
    schedule = entry.schedule
    if isinstance(schedule, schedules.crontab):
        return _latest_occurrence(schedule, now)
    step = _slot_seconds(entry)
    return datetime.fromtimestamp(math.floor(now.timestamp() / step) * step, tz=timezone.utc)


def _slot_seconds(entry: ScheduleEntry) -> float:
    """How long one slot of an entry that is not a crontab lasts (see :func:`slot_of`)."""
    schedule = entry.schedule
    if isinstance(schedule, schedules.schedule):
        return max(float(schedule.run_every.total_seconds()), 1.0)
    return 1.0


def _next_occurrence(schedule: schedules.crontab, after: datetime) -> datetime:
    """The crontab's first occurrence after ``after``, in UTC, as Celery's own schedule counts
    it (in the schedule's time zone)."""
    start, delta, _ = schedule.remaining_delta(after.astimezone(schedule.tz))
    occurrence: datetime = start + delta
    return occurrence.astimezone(timezone.utc)


def _is_occurrence(schedule: schedules.crontab, when: datetime) -> bool:
    return _latest_occurrence(schedule, when) == when


def _latest_occurrence(schedule: schedules.crontab, now: datetime) -> datetime:
    """The crontab's latest occurrence at or before ``now``: it looks back a minute, then twice
    as far each time until an occurrence falls in between (Celery refuses a crontab that never
    occurs), then halves the span that holds the latest one down to a minute, which holds no
    other: a few dozen of Celery's steps, however many occurrences lie in between (a crontab of
    every minute of January, sent in December)."""
    back = timedelta(minutes=1)
    while _next_occurrence(schedule, now - back) > now:
        back *= 2
    # The first occurrence after `early` is at or before `now`; the first after `late` is not.
    early, late = now - back, now
    while late - early > timedelta(minutes=1):
        middle = early + (late - early) / 2
        if _next_occurrence(schedule, middle) <= now:
            early = middle
        else:
            late = middle
    occurrence = _next_occurrence(schedule, early)
    while (later := _next_occurrence(schedule, occurrence)) <= now:
        occurrence = later
    return occurrence


def _on_the_grid(entry: ScheduleEntry, now: datetime, *, catch_up: bool = False) -> None:
    """Count an interval entry's last run from the start of its slot at ``now``, so that it
    comes due where its next slot starts, on every instance alike: counted from whenever an
    instance started, an entry whose period is longer than beat instances live (restarted by
    deploys) would never come due. ``catch_up``: due at once instead, for the slot at ``now``,
    if that slot began less than half a period ago (later, its next one comes soon enough), and
    never later than it already is."""
    schedule = entry.schedule
    if not isinstance(schedule, schedules.schedule):
        return
    start = slot_of(entry, now)
    if not catch_up:
        entry.last_run_at = start
        return
    period = schedule.run_every
    target = start - period if now - start < period / 2 else start
    entry.last_run_at = min(schedule.maybe_make_aware(entry.last_run_at), target)


def schedule_digest(entries: Iterable[ScheduleEntry]) -> str:
    """Twelve hex digits that every instance running the same schedule computes alike, in any
    process: from each entry's name, task, schedule (an interval's seconds, a crontab's fields
    and time zone), arguments and keyword arguments."""
    described = sorted(
        json.dumps(
            _canonical(
                [entry.name, entry.task, _schedule_fields(entry.schedule), entry.args, entry.kwargs]
            )
        )
        for entry in entries
    )
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:12]


def _schedule_fields(schedule: object) -> object:
    if isinstance(schedule, schedules.crontab):
        fields = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
        matched = [sorted(getattr(schedule, field)) for field in fields]
        return ["crontab", *matched, str(schedule.tz)]
    if isinstance(schedule, schedules.schedule):
        return ["every", schedule.run_every.total_seconds(), schedule.relative]
    return _repr(schedule)


#: Where an object's default ``repr`` puts its address, which differs from process to process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _repr(value: object) -> str:
    """``value``'s ``repr`` without the address a default one shows."""
    return _ADDRESS.sub("", repr(value))


def _canonical(value: object) -> object:
    """``value`` as JSON can hold it, the same whatever the process's hash seed: a mapping as
    its key and value pairs and a set as its items, each in the order of their JSON; a tuple as
    a list; anything else JSON has no form for as its ``repr`` (:func:`_repr`)."""
    if isinstance(value, Mapping):
        pairs = [[_canonical(key), _canonical(item)] for key, item in value.items()]
        return {"mapping": sorted(pairs, key=json.dumps)}
    if isinstance(value, (set, frozenset)):
        return {"set": sorted((_canonical(item) for item in value), key=json.dumps)}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    return _repr(value)


class FencedScheduler(Scheduler):  # type: ignore[misc]
    """The beat scheduler of celery-fence (alias ``fence`` for ``celery beat -S``)."""

    max_interval: float

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.fence = Fence.of(app)
        try:
            settings = self.fence.settings
        except ConfigurationError as exc:
            refuse_start("beat", exc)
        self.lease_name = settings.beat_lease or f"scheduler:{app.main or 'celery'}"
        # Unique per start: a container restarted with the same hostname and pid is a new holder.
        self.holder = f"beat@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ttl = settings.beat_ttl
        self.renew_interval = settings.beat_renew_interval
        self.max_hold = settings.beat_max_hold
        self.lease: Lease | None = None
        self.highest_epoch = 0
        self.halted: str | None = None
        self._closed = False
        self._schedule_read = False  # a lazy instance (the banner's) reads it when asked
        self._renew_at = 0.0
        self._standby_reason: str | None = None
        #: The lease this instance last stepped down from, token and all.
        self._given_up: Lease | None = None
        # When the last tick brought the entries' counts up to date (sending or passing what
        # was due), by the wall clock: a host suspended, or the process stopped, stops both.
        self._counted_at: datetime | None = None
        # As a worker does, beat refuses to start without the schema; a database it cannot reach
        # yet only keeps it on standby (its ticks say so).
        try:
            self.fence.store.check_schema()
        except (ConfigurationError, SchemaNotInstalledError) as exc:
            refuse_start("beat", exc)
        except FenceDatabaseError as exc:
            self._standby(f"database unavailable: {exc}")
        super().__init__(app, *args, **kwargs)
        self.max_interval = min(self.max_interval, self.renew_interval)

    @property
    def info(self) -> str:
        if not self._schedule_read:
            # Celery makes the banner's scheduler lazily, without its schedule.
            self.setup_schedule()
        entries = len(self.schedule)
        return (
            f"    . lease -> {self.lease_name} (ttl {self.ttl:g}s, renew every "
            f"{self.renew_interval:g}s, held at most {self.max_hold:g}s at one epoch, "
            f"environment {self.fence.settings.environment})\n"
            f"    . holder -> beat@{socket.gethostname()}:{os.getpid()} (and a nonce per start)\n"
            f"    . purpose -> {self.purpose} ({entries} {'entry' if entries == 1 else 'entries'})"
        )

    @property
    def purpose(self) -> str:
        """The purpose of the lease this instance takes: its schedule, by digest (see
        :func:`schedule_digest`)."""
        return f"celery beat, schedule {schedule_digest(self.schedule.values())}"

    def setup_schedule(self) -> None:
        """The schedule, on the grid of its slots (see :meth:`_catch_up`). Beat refuses to start
        with an entry whose name no slot can be claimed for (see :func:`validation.check_entry`):
        it could never be sent."""
        super().setup_schedule()
        for name in self.schedule:
            try:
                validation.check_entry(name)
            except ConfigurationError as exc:
                refuse_start("beat", ConfigurationError(f"beat_schedule entry {name!r}: {exc}"))
        self._schedule_read = True
        self._catch_up()

    def _catch_up(self) -> None:
        """Make each interval entry due at once for its current slot if that slot began less
        than half a period ago, else at its next slot: a leader that starts or takes over then
        sends a slot whose start fell while no instance led, unless one sent it already (its
        claim says). A leader counts each crontab entry's last run from its latest claimed slot,
        and says which interval slots no instance sent (see :meth:`_from_their_claims`)."""
        now = datetime.now(timezone.utc)
        for entry in self.schedule.values():
            _on_the_grid(entry, now, catch_up=True)
        if self.lease is not None:
            self._from_their_claims(now)

    def _from_their_claims(self, now: datetime) -> None:
        """Read the latest slot any instance claimed for each entry. A crontab entry counts its
        last run from it, as Celery's own scheduler counts it from its schedule file: an
        occurrence that fell since, while no instance led, comes due at once, within Celery's
        ``beat_cron_starting_deadline`` when set. An entry never sent, or whose latest slot is
        not an occurrence of its crontab now (the crontab changed since), keeps its own
        count: it comes due at its next occurrence. For an interval entry, the slots between
        its latest claim and the first this leader sends, none of which any instance sent, are
        logged and counted (``beat.slots_missed``). Any other schedule (``solar``, one of the
        app's own) has slots of a second, which differ from one instance to the next: such an
        entry counts its last run from when its latest slot was sent, if that is later than
        its own count, so that an event the previous leader sent is not sent again. An entry
        whose count cannot be told from its claim is logged and keeps its own count."""
        entries = list(self.schedule.values())
        try:
            latest = self.fence.store.latest_dispatches(
                self.lease_name, (entry.name for entry in entries)
            )
        except FenceDatabaseError as exc:
            log.warning(
                "beat could not read the slots claimed before it led %s; crontab entries "
                "count from their next occurrence, and interval slots nobody sent go "
                "unreported: %s",
                self.lease_name,
                exc,
                extra={"lease": self.lease_name},
            )
            return
        for entry in entries:
            claimed = latest.get(entry.name)
            if claimed is None:
                continue
            try:
                self._count_from(entry, claimed, now)
            except Exception:  # as Celery's tick does for an entry it cannot tell is due
                log.exception(
                    "beat cannot count %r from its latest slot, %s; it counts from its own last "
                    "run",
                    entry.name,
                    claimed.slot.isoformat(),
                    extra={"lease": self.lease_name, "entry": entry.name},
                )

    def _count_from(self, entry: ScheduleEntry, claimed: Dispatch, now: datetime) -> None:
        """Count ``entry`` from ``claimed``, its latest slot (see :meth:`_from_their_claims`)."""
        schedule = entry.schedule
        if isinstance(schedule, schedules.crontab):
            if _is_occurrence(schedule, claimed.slot):
                entry.last_run_at = claimed.slot.astimezone(schedule.tz)
        elif isinstance(schedule, schedules.schedule):
            if slot_of(entry, claimed.slot) == claimed.slot:
                # Not for a slot off the entry's grid now: its period changed since.
                self._say_missed(entry, claimed.slot, now)
        elif claimed.dispatched_at > maybe_make_aware(entry.last_run_at):
            entry.last_run_at = claimed.dispatched_at

    def _say_missed(self, entry: ScheduleEntry, claimed: datetime, now: datetime) -> None:
        """Log and count the slots of an interval entry after ``claimed`` (its latest claim)
        that this leader, taking the lease at ``now``, does not send: no instance sent them, and
        the last of them began more than half a period before ``now``."""
        step = timedelta(seconds=_slot_seconds(entry))
        start = slot_of(entry, now)
        due_now = entry.schedule.maybe_make_aware(entry.last_run_at) < start
        first = start if due_now else start + step
        missed = round((first - claimed) / step) - 1
        if missed <= 0:
            return
        self.fence.store.metrics.incr("beat.slots_missed", missed)
        log.warning(
            "beat leads %s without sending %d slot(s) of %r, %s to %s: no instance sent them, "
            "and the last began more than half a period ago; next slot %s",
            self.lease_name,
            missed,
            entry.name,
            (claimed + step).isoformat(),
            (first - step).isoformat(),
            first.isoformat(),
            extra={"lease": self.lease_name, "entry": entry.name},
        )

    def is_due(self, entry: ScheduleEntry) -> tuple[bool, float]:
        """Celery's answer, except that an interval entry sent now comes due again where its
        next slot starts, not a period from now, and is never due again within the slot it was
        last sent for: a period shorter than a slot's second, or a ``relative`` one (which
        Celery rounds), would otherwise come due again for a slot already claimed."""
        due, next_time = super().is_due(entry)
        if due and isinstance(entry.schedule, schedules.schedule):
            now = datetime.now(timezone.utc)
            start = slot_of(entry, now)
            next_time = _slot_seconds(entry) - (now - start).total_seconds()
            due = start > entry.schedule.maybe_make_aware(entry.last_run_at)
        return bool(due), float(next_time)

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        new_entry: ScheduleEntry = super().reserve(entry)
        _on_the_grid(new_entry, datetime.now(timezone.utc))
        return new_entry

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._closed:
            # Closed by the beat's SIGTERM or SIGINT handler, whose SystemExit an exception in
            # the publish it interrupted may have replaced: the beat stops, and never leads again.
            raise SystemExit()
        if self.halted is not None:
            log.critical("beat halted, not scheduling: %s", self.halted)
            return float(self.max_interval)
        self.lead()
        if self.lease is None:
            self._pass_due_entries()
            self._counted_at = datetime.now(timezone.utc)
            return float(self.renew_interval)
        interval: float = super().tick(*args, **kwargs)
        self._counted_at = datetime.now(timezone.utc)
        return min(interval, self._until_renewal())

    def lead(self) -> None:
        """Renew the lease when due, or try to take it; step down or halt as the answers say.
        A leader whose maximum hold would run out before its next renewal gives the lease up
        and takes it again at the next epoch, so that no slot passes while nobody leads."""
        # Whether this instance missed ticks (they come at most a renew interval apart), judged
        # before this call's own requests: the time they take (a slow acquisition) is not time
        # it was stopped.
        counted = self._counted_at
        stopped = counted is not None and (
            datetime.now(timezone.utc) - counted > timedelta(seconds=2 * self.renew_interval)
        )
        lease = self.lease
        continuing = False
        if lease is not None:
            if self._until_renewal() <= 0 or not lease.trusted:
                self._renew()
            lease = self.lease
            if (
                lease is None
                or lease.expires_at < lease.hold_until
                or lease.remaining() > self.renew_interval
            ):
                return
            log.info(
                "beat lease %s reaches its maximum hold at epoch %d: taking the next epoch",
                self.lease_name,
                lease.epoch,
                extra={"lease": self.lease_name, "epoch": lease.epoch},
            )
            try:
                self.fence.store.release(lease)
            except LeaseLostError as exc:
                self._step_down(str(exc), lease)
                return
            except FenceDatabaseError as exc:
                # Still trusted until its deadline: kept, and given up on a later tick.
                log.warning(
                    "beat could not give up %s at its maximum hold, keeping epoch %d: %s",
                    self.lease_name,
                    lease.epoch,
                    exc,
                    extra={"lease": self.lease_name, "epoch": lease.epoch},
                )
                return
            self.lease = None
            continuing = True
        purpose = self.purpose
        try:
            got = self.fence.store.acquire(
                self.lease_name,
                holder=self.holder,
                ttl=self.ttl,
                environment=self.fence.settings.environment,
                max_hold=self.max_hold,
                purpose=purpose,
            )
        except LeasePausedError as exc:
            self._standby(f"lease paused: {exc}")
            return
        except SchemaNotInstalledError as exc:
            self._standby(str(exc))
            return
        except FenceDatabaseError as exc:
            self._standby(f"database unavailable: {exc}")
            return
        if got.lease is None:
            owner = got.owner
            given_up, self._given_up = self._given_up, None
            if owner is not None and owner.holder == self.holder:
                if given_up is not None and given_up.epoch == owner.epoch:
                    # The epoch this instance stepped down from (its claim refused during a
                    # pause since ended, say): given back, so that the lease need not run out.
                    problem = self._give_back(given_up)
                    if problem is None:
                        self.lead()  # once: nothing is left to give back
                        return
                    self._standby(
                        f"epoch {owner.epoch}, which this instance stepped down from, could not "
                        f"be given back ({problem}); waiting for it to expire"
                    )
                    return
                # An earlier acquisition of ours committed but its answer was lost: without its
                # token this instance cannot use it, so it waits for it to expire.
                self._standby(
                    f"epoch {owner.epoch} was granted to this instance but its answer was lost; "
                    "waiting for it to expire"
                )
                return
            self._standby(
                f"standby: {owner.holder} leads at epoch {owner.epoch}"
                f"{self._disagreement(owner, purpose)}"
                if owner
                else got.outcome
            )
            return
        if got.lease.epoch <= self.highest_epoch:
            self._halt(
                f"won epoch {got.lease.epoch} after having seen epoch {self.highest_epoch}: "
                "epochs must only grow"
            )
            return
        self._take(got.lease)
        # Taken again at once after its maximum hold, the lease was never away: what this
        # instance counted holds (a catch-up would make the slot it just sent due again).
        if not continuing:
            if stopped:
                # Stopped (SIGSTOP, a suspended host), this instance counts its entries from
                # where it stopped. They are passed as on standby first, as the ticks it missed
                # would have, so that it does not send a slot that began more than half a period
                # ago.
                self._pass_due_entries()
            self._catch_up()
            # Celery's heap still holds the entries as they were when this instance last led: on
            # standby, _pass_due_entries replaced them in the schedule, but Celery rebuilds its
            # heap only when an entry's task, arguments, options or schedule change, never for a
            # new last run. Left as it was, the heap would send at once what came due meanwhile.
            self._heap = None
        log.warning(
            "beat leads %s at epoch %d as %s",
            self.lease_name,
            got.lease.epoch,
            self.holder,
            extra={"lease": self.lease_name, "epoch": got.lease.epoch, "holder": self.holder},
        )

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        if self._closed:
            return None  # the rest of a tick its shutdown interrupted
        lease = self.lease
        if lease is None or not lease.trusted:
            self._step_down("lease not trusted at dispatch time", lease)
            return None
        slot = slot_of(entry, datetime.now(timezone.utc))
        try:
            claimed = self.fence.store.claim_slot(
                lease, entry=entry.name, slot=slot, task=entry.task
            )
        except LeaseLostError as exc:
            self._step_down(f"dispatch of {entry.name} rejected: {exc}", lease)
            return None
        except FenceDatabaseError as exc:
            # One line, not Celery's "Message Error" with a stack at every slot of an outage.
            log.warning(
                "slot %s of %s not sent: its claim failed: %s",
                slot.isoformat(),
                entry.name,
                exc,
                extra={"lease": self.lease_name, "entry": entry.name},
            )
            return None
        if not claimed:
            log.info(
                "slot %s of %s was already dispatched; not sending again",
                slot.isoformat(),
                entry.name,
                extra={"lease": self.lease_name, "entry": entry.name},
            )
            return None
        headers = dict(entry.options.get("headers") or {})
        # A publication id of its own: runs of two dispatches sent with one task id (an entry's
        # task_id option) are told apart, as a redelivery of each is told from the other.
        headers[HEADER] = published(FenceHeader.for_lease(lease, "join").to_message())
        # Options of the entry's own: Celery's entry shares its dict with the beat_schedule
        # setting it came from, which stays as configured.
        entry.options = {**entry.options, "headers": headers}
        return super().apply_async(entry, producer=producer, advance=advance, **kwargs)

    def close(self) -> None:
        """Stop leading and release the lease. Beat closes its scheduler twice on SIGTERM or
        SIGINT: in the signal handler, which may interrupt a call of the store's, and once its
        loop has ended: a release that failed the first time is tried again the second."""
        self._closed = True
        lease = self.lease
        if lease is not None:
            try:
                self.fence.store.release(lease)
            except (LeaseLostError, FenceDatabaseError) as exc:
                log.warning("beat could not release %s on shutdown: %s", self.lease_name, exc)
                if isinstance(exc, LeaseLostError):
                    self.lease = None  # nothing left to release
            else:
                self.lease = None
        super().close()

    # -- internals --------------------------------------------------------------------------

    def _pass_due_entries(self) -> None:
        """On standby, move due entries on without sending them, as the leader does when it
        sends them: a standby that takes over then has no backlog of slots to catch up on."""
        for entry in list(self.schedule.values()):
            try:
                due, _ = self.is_due(entry)
            except Exception:
                # As the leader's tick does: one entry whose next run cannot be told must not
                # stop beat, nor the other entries.
                log.exception("beat on standby cannot tell whether %r is due", entry.name)
                continue
            if due:
                self.reserve(entry)

    def _disagreement(self, owner: Owner, purpose: str) -> str:
        """What the leader's lease says of its schedule and environment where this instance's
        (its ``purpose`` and environment) differ (an instance left on an older configuration, or
        one of another environment on the same lease), to be said with the standby's reason;
        empty where they agree."""
        environment = self.fence.settings.environment
        differences = []
        if owner.purpose != purpose:
            differences.append(f"purpose {owner.purpose!r}, this instance's {purpose!r}")
        if owner.environment != environment:
            differences.append(f"environment {owner.environment}, this instance's {environment}")
        if not differences:
            return ""
        return f"; the leader's lease differs: {'; '.join(differences)}"

    def _until_renewal(self) -> float:
        return self._renew_at - time.monotonic()

    def _take(self, lease: Lease) -> None:
        self.lease = lease
        self.highest_epoch = max(self.highest_epoch, lease.epoch)
        self._renew_at = time.monotonic() + self.renew_interval
        self._standby_reason = None
        self._given_up = None

    def _renew(self) -> None:
        lease = self.lease
        assert lease is not None
        try:
            renewed = self.fence.store.renew(lease)
        except LeaseLostError as exc:
            self._step_down(str(exc), lease)
            return
        except FenceDatabaseError as exc:
            if not lease.trusted:
                self._step_down(f"could not renew before the deadline: {exc}", lease)
            else:
                # Try again sooner than the interval but not at once: tick() returns the time
                # until then, and celery beat ticks again without sleeping when it is zero.
                wait = retry_after_failure(lease, self.renew_interval)
                self._renew_at = time.monotonic() + wait
                log.warning("beat renewal failed, retrying in %.2fs: %s", wait, exc)
            return
        if renewed.epoch != lease.epoch:
            self._halt(f"renewal returned epoch {renewed.epoch} for epoch {lease.epoch}")
            return
        self._take(renewed)

    def _give_back(self, lease: Lease) -> str | None:
        """Release ``lease``, an epoch this instance stepped down from that the database still
        counts held; ``None`` when it did, else why not."""
        try:
            self.fence.store.release(lease)
        except (LeaseLostError, FenceDatabaseError) as exc:
            return str(exc)
        log.info(
            "beat gave back epoch %d of %s, which it had stepped down from",
            lease.epoch,
            self.lease_name,
            extra={"lease": self.lease_name, "epoch": lease.epoch},
        )
        return None

    def _step_down(self, reason: str, lease: Lease | None) -> None:
        self.lease = None
        self._given_up = lease
        self._standby(f"stepped down from epoch {lease.epoch if lease else '?'}: {reason}")

    def _standby(self, reason: str) -> None:
        if reason != self._standby_reason:
            log.warning("beat on standby for %s: %s", self.lease_name, reason)
            self._standby_reason = reason

    def _halt(self, reason: str) -> None:
        self.lease = None
        self.halted = reason
        log.critical("beat stops scheduling %s: %s", self.lease_name, reason)
