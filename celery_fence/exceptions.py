"""The one exception tree of celery-fence. Every error carries what a caller needs to act."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_fence.models import Owner


class FenceError(Exception):
    """Root of every error celery-fence raises."""


class ConfigurationError(FenceError, ValueError):
    """An argument or setting is invalid; raised before anything is written."""


class FenceDatabaseError(FenceError):
    """The database failed or could not be reached; the driver's error is the ``__cause__``."""


class SchemaNotInstalledError(FenceDatabaseError):
    """The ``celery_fence`` schema is missing or out of date: run ``celery-fence install``."""


class LeaseError(FenceError):
    """An answer about a lease that is not the caller's to use.

    ``lease_name`` names the lease, ``epoch`` is the epoch the caller held or claimed (``None``
    when it never held one) and ``owner`` is the current owner's safe metadata (never a token).
    """

    def __init__(
        self,
        message: str,
        *,
        lease_name: str = "",
        epoch: int | None = None,
        owner: Owner | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.lease_name = lease_name
        self.epoch = epoch
        self.owner = owner
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Celery pickles a task's error before reporting it; without this the keyword-only
        # fields make unpickling fail and Celery falls back to a bare FenceError.
        rebuild = partial(
            type(self),
            lease_name=self.lease_name,
            epoch=self.epoch,
            owner=self.owner,
            reason=self.reason,
        )
        return rebuild, self.args


class LeaseHeldError(LeaseError):
    """Another holder has the lease."""


class LeaseBusyError(LeaseHeldError):
    """The lease row stayed locked by a fenced writer past the acquisition's lock timeout."""


class LeasePausedError(LeaseError):
    """The lease is paused; ``owner.paused_by`` and ``owner.paused_reason`` say who and why."""


class LeaseLostError(LeaseError):
    """The caller no longer holds the lease (``reason``: expired, superseded, released, paused,
    forged, missing or malformed)."""


class StaleEpochError(LeaseLostError):
    """A fenced write was rejected: its epoch is no longer the held epoch of the lease. The
    transaction it ran in was rolled back and the stale run recorded."""
