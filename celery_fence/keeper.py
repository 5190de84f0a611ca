"""LeaseKeeper: renews a lease in the background and tells the work when it is lost."""

from __future__ import annotations

import threading
from collections.abc import Callable

from celery_fence.exceptions import LeaseLostError
from celery_fence.models import Lease
from celery_fence.observe import log

Refresh = Callable[[Lease], Lease]


class LeaseKeeper:
    """Calls ``refresh(lease)`` every ``interval`` seconds on a thread of its own.

    ``refresh`` is normally :meth:`LeaseStore.renew` on a store with a connection of its own, so
    a busy pool in the work cannot starve renewal. A definite "not yours"
    (:class:`LeaseLostError`) ends the lease at once; any other error is retried until the
    lease's monotonic deadline passes, then the lease counts as lost. ``lost`` is an event the
    work can check; ``lease`` is always the latest renewed lease.
    """

    def __init__(self, lease: Lease, refresh: Refresh, *, interval: float) -> None:
        self._lease = lease
        self._refresh = refresh
        self.interval = interval
        self.lost = threading.Event()
        self.error: LeaseLostError | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"celery-fence-keeper:{lease.name}", daemon=True
        )

    @property
    def lease(self) -> Lease:
        with self._lock:
            return self._lease

    @property
    def held(self) -> bool:
        """True while the lease was neither lost nor is past its deadline."""
        return not self.lost.is_set() and self.lease.trusted

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            lease = self.lease
            try:
                renewed = self._refresh(lease)
            except LeaseLostError as exc:
                self._lose(exc)
                return
            except Exception as exc:  # anything but a definite "not yours" is ridden out
                if not lease.trusted:
                    self._lose(
                        LeaseLostError(
                            f"lease {lease.name} epoch {lease.epoch} passed its deadline "
                            f"while the database was unreachable: {exc}",
                            lease_name=lease.name,
                            epoch=lease.epoch,
                            reason="expired",
                        )
                    )
                    return
                # Retry sooner than the normal interval, but never past the deadline.
                wait = max(0.05, min(self.interval / 4, lease.remaining() / 2))
                log.warning(
                    "renewing lease %s failed, retrying in %.2fs: %s",
                    lease.name,
                    wait,
                    exc,
                    extra={"lease": lease.name, "epoch": lease.epoch},
                )
                continue
            with self._lock:
                self._lease = renewed
            wait = self.interval

    def _lose(self, error: LeaseLostError) -> None:
        self.error = error
        self.lost.set()
        log.error(
            "lease %s lost: %s",
            error.lease_name,
            error,
            extra={"lease": error.lease_name, "epoch": error.epoch, "reason": error.reason},
        )
