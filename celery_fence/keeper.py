"""LeaseKeeper: renews a lease in the background and tells the work when it is lost."""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable

from celery_fence.exceptions import LeaseLostError
from celery_fence.models import Lease
from celery_fence.observe import log

Refresh = Callable[[Lease], Lease]

#: The shortest wait before another attempt, so that a lease about to run out is not polled in a
#: tight loop.
MIN_WAIT = 0.05
#: The most renewals a process runs at once, each on a thread of its own: a renewal kept waiting
#: (for the fenced transactions open on its lease, up to the lock timeout) holds up its own
#: lease's renewals only. Renewals due beyond that wait for one in flight to end. The renewals'
#: store needs as many connections (``LeaseStore.dedicated()`` opens up to as many).
RENEWALS_AT_ONCE = 32


def next_attempt(lease: Lease, interval: float) -> float:
    """Seconds until the next renewal of ``lease``: ``interval``, or sooner when the lease has
    less than two intervals of trust left, so that the attempt comes while it is still trusted
    with time to spare. A lease this holder renews itself has most of its TTL left, and
    ``interval`` applies; one near its maximum hold, or a lease taken for less than the TTL
    renewals extend it by, may have less left than that."""
    return max(MIN_WAIT, min(interval, lease.remaining() / 2))


def retry_after_failure(lease: Lease, interval: float) -> float:
    """Seconds until the next attempt after a renewal failed without a definite answer: sooner
    than the normal interval, but never past the deadline, and never in a tight loop."""
    return max(MIN_WAIT, min(interval / 4, lease.remaining() / 2))


class LeaseKeeper:
    """Calls ``refresh(lease)`` every ``interval`` seconds, off the caller's thread; sooner
    when the refreshed lease is trusted for less than two intervals (see :func:`next_attempt`).

    ``refresh`` is normally :meth:`LeaseStore.renew` on a store with a connection of its own, so
    a busy pool in the work cannot starve renewal. A definite "not yours"
    (:class:`LeaseLostError`) ends the lease at once; any other error is retried until the
    lease's monotonic deadline passes, then the lease counts as lost; one that is not an
    ``Exception`` ends the renewals, and the lease counts as lost at once. ``lost`` is an event the
    work can check; ``lease`` is always the latest renewed lease.

    The keepers of a process share background threads: one that keeps the queue of renewals
    due, and up to :data:`RENEWALS_AT_ONCE` that renew, started as renewals overlap. Starting and
    stopping a keeper costs no thread of its own.
    """

    def __init__(self, lease: Lease, refresh: Refresh, *, interval: float) -> None:
        self._lease = lease
        self._refresh = refresh
        self.interval = interval
        self.lost = threading.Event()
        self.error: LeaseLostError | None = None
        self._stopped = False
        self._failure: Exception | None = None  # the last renewal's error, until one succeeds
        self._lock = threading.Lock()
        self._renewing = threading.Lock()

    @property
    def lease(self) -> Lease:
        with self._lock:
            return self._lease

    @property
    def held(self) -> bool:
        """True while the lease was neither lost nor is past its deadline."""
        return not self.lost.is_set() and self.lease.trusted

    def start(self) -> LeaseKeeper:
        _renewals.schedule(self, time.monotonic() + next_attempt(self.lease, self.interval))
        return self

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called (a lost lease sets ``lost``, not this)."""
        return self._stopped

    def stop(self) -> None:
        """No renewal after this returns (one in flight is waited for). The keeper counts as
        stopped before that wait, so that a signal interrupting it (a task's soft time limit)
        cannot leave it renewing."""
        self._stopped = True
        with self._renewing:
            pass

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def renew_once(self) -> float | None:
        """Renew now; the seconds until the next attempt, or ``None`` when this keeper is done."""
        with self._renewing:
            if self._stopped:
                return None
            lease = self.lease
            # Past the deadline the work counts the lease lost: a renewal now would bring it
            # back after the work saw it gone.
            if not lease.trusted:
                self._lose_to_deadline(lease)
                return None
            try:
                renewed = self._refresh(lease)
            except LeaseLostError as exc:
                self._lose(exc)
                return None
            except Exception as exc:  # anything but a definite "not yours" is ridden out
                self._failure = exc
                if not lease.trusted:
                    self._lose_to_deadline(lease)
                    return None
                wait = retry_after_failure(lease, self.interval)
                log.warning(
                    "renewing lease %s failed, retrying in %.2fs: %s",
                    lease.name,
                    wait,
                    exc,
                    extra={"lease": lease.name, "epoch": lease.epoch},
                )
                return wait
            except BaseException as exc:  # ends the renewer thread: no renewal comes after it
                self._lose(
                    LeaseLostError(
                        f"lease {lease.name} epoch {lease.epoch} is no longer renewed: its "
                        f"renewal was ended by {exc!r}",
                        lease_name=lease.name,
                        epoch=lease.epoch,
                        reason="expired",
                    )
                )
                raise
            self._failure = None
            with self._lock:
                self._lease = renewed
            return next_attempt(renewed, self.interval)

    def _lose_to_deadline(self, lease: Lease) -> None:
        why = (
            "before it could be renewed"
            if self._failure is None
            else f"while renewal kept failing: {self._failure}"
        )
        self._lose(
            LeaseLostError(
                f"lease {lease.name} epoch {lease.epoch} passed its deadline {why}",
                lease_name=lease.name,
                epoch=lease.epoch,
                reason="expired",
            )
        )

    def _lose(self, error: LeaseLostError) -> None:
        self.error = error
        self.lost.set()
        log.error(
            "lease %s lost: %s",
            error.lease_name,
            error,
            extra={"lease": error.lease_name, "epoch": error.epoch, "reason": error.reason},
        )


class _Renewals:
    """The process's renewal threads: a queue of keepers ordered by when each is due, and the
    threads that renew those due, one renewal each at a time, as many as there are renewals in
    flight, up to :data:`RENEWALS_AT_ONCE`. A forked child starts afresh, with an empty queue
    and threads of its own once it needs them."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._due: list[tuple[float, int, LeaseKeeper]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._running = False
        self._ready: queue.SimpleQueue[LeaseKeeper] = queue.SimpleQueue()
        self._in_flight = 0  # renewals handed to the renewers and not yet ended
        self._renewers = 0

    def schedule(self, keeper: LeaseKeeper, at: float) -> None:
        with self._wake:
            if not self._running:
                self._running = True
                threading.Thread(
                    target=self._run, name="celery-fence-renewals", daemon=True
                ).start()
            # Wake the thread only when this keeper is due before the one it waits for.
            sooner = not self._due or at < self._due[0][0]
            heapq.heappush(self._due, (at, next(self._order), keeper))
            if sooner:
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    # Stopped keepers leave the queue without a renewal attempt, all those at
                    # its head at once, whenever the thread wakes: keepers of runs that end
                    # before their first renewal never wake it up one by one.
                    while self._due and self._due[0][2].stopped:
                        heapq.heappop(self._due)
                    if self._due and self._due[0][0] <= time.monotonic():
                        break
                    timeout = self._due[0][0] - time.monotonic() if self._due else None
                    self._wake.wait(timeout)
                _, _, keeper = heapq.heappop(self._due)
                self._in_flight += 1
                if self._in_flight > self._renewers and self._renewers < RENEWALS_AT_ONCE:
                    self._renewers += 1
                    threading.Thread(
                        target=self._renew,
                        name=f"celery-fence-renewer-{self._renewers}",
                        daemon=True,
                    ).start()
            self._ready.put(keeper)

    def _renew(self) -> None:
        try:
            while True:
                keeper = self._ready.get()
                try:
                    wait = keeper.renew_once()
                finally:
                    with self._wake:
                        self._in_flight -= 1
                if wait is not None:
                    self.schedule(keeper, time.monotonic() + wait)
        finally:
            # Ended by what a renewal let through (renew_once() catches every Exception): the
            # next renewal due starts another renewer in its place.
            with self._wake:
                self._renewers -= 1


_renewals = _Renewals()
