"""The one exception tree of celery-fence. Every error carries what a caller needs to act."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_fence.models import Owner


class FenceError(Exception):
    """Root of every error celery-fence raises."""


class ConfigurationError(FenceError, ValueError):
    """An argument or setting is invalid; raised before anything is written."""


class FenceDatabaseError(FenceError):
    """The database failed or could not be reached; the driver's error is the ``__cause__``.
    ``database``, when set, names the database the error is about (its URL, passwords hidden),
    which the message then ends with: ``... [database postgresql+psycopg://...]``."""

    database: str | None = None

    def __str__(self) -> str:
        message = super().__str__()
        return message if self.database is None else f"{message} [database {self.database}]"


class SchemaNotInstalledError(FenceDatabaseError):
    """The ``celery_fence`` schema is missing or out of date: run ``celery-fence install``."""


class LeaseError(FenceError):
    """An answer about a lease that is not the caller's to use.

    ``lease_name`` names the lease, ``epoch`` is the epoch the caller held or claimed (``None``
    when it never held one) and ``owner`` is the current owner's safe metadata (never a token).

    The error's ``args`` are its message and these fields as plain values (the owner's times as
    ISO 8601 strings), from which it is built again whole: a result backend that stores an error
    by its class and ``args`` (Celery's, with the JSON serializer) gives the caller the same
    error back, not only its message.
    """

    def __init__(
        self,
        message: str,
        fields: Mapping[str, Any] | None = None,
        *,
        lease_name: str = "",
        epoch: int | None = None,
        owner: Owner | None = None,
        reason: str | None = None,
    ) -> None:
        if isinstance(fields, Mapping):
            lease_name = str(fields.get("lease_name") or "")
            epoch = fields.get("epoch")
            reason = fields.get("reason")
            owner = _owner_of(fields.get("owner"))
        self.lease_name = lease_name
        self.epoch = epoch
        self.owner = owner
        self.reason = reason
        super().__init__(
            message,
            {
                "lease_name": lease_name,
                "epoch": epoch,
                "reason": reason,
                "owner": None if owner is None else owner.to_fields(),
            },
        )

    def __str__(self) -> str:
        return str(self.args[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.args[0]!r})"


def _owner_of(fields: object) -> Owner | None:
    """The owner ``fields`` describe, if they do (see :meth:`Owner.from_fields`)."""
    if not isinstance(fields, Mapping):
        return None
    try:
        return Owner.from_fields(fields)
    except (TypeError, ValueError):
        return None


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
