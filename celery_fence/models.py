"""Frozen value objects: leases, owners, acquisitions, stale-run and history records."""

from __future__ import annotations

import dataclasses
import time
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

Outcome = Literal["acquired", "held", "busy", "paused", "joined", "resumed", "shared", "done"]
LeaseState = Literal["held", "expired", "released", "paused"]


@dataclass(frozen=True, kw_only=True)
class Owner:
    """What anyone may learn about a lease: never its token."""

    name: str
    environment: str
    holder: str
    purpose: str
    epoch: int
    state: LeaseState
    acquired_at: datetime
    renewed_at: datetime
    expires_at: datetime
    hold_until: datetime
    released_at: datetime | None
    paused: bool
    paused_reason: str | None
    paused_by: str | None
    paused_at: datetime | None

    @property
    def held(self) -> bool:
        return self.state == "held"

    def to_fields(self) -> dict[str, Any]:
        """The owner as plain values, its times as ISO 8601 strings: what any serializer keeps."""
        return {
            key: value.isoformat() if isinstance(value, datetime) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Owner:
        """The owner :meth:`to_fields` gave ``fields`` for. Raises ``TypeError`` for a missing
        or unknown field and ``ValueError`` for a time that is not ISO 8601; the other values
        are taken as given."""
        values = dict(fields)
        for key in _OWNER_TIMES:
            if isinstance(values.get(key), str):
                values[key] = datetime.fromisoformat(values[key])
        return cls(**values)


_OWNER_TIMES = tuple(
    name
    for name, hint in typing.get_type_hints(Owner).items()
    if hint is datetime or datetime in typing.get_args(hint)
)


@dataclass(frozen=True, kw_only=True)
class Lease:
    """A lease this process holds: the epoch is its fencing token, the token its secret.

    ``deadline`` is a ``time.monotonic()`` value taken before the request that granted the lease
    was sent, plus the time the database granted, less a safety margin: past it, the holder
    stops trusting the lease even if the database has not yet handed it on.

    ``sharer`` is the delivery a continuation joined a shared lease as (see
    :meth:`LeaseStore.rejoin`), and ``joined_at`` when it joined, which renewals keep and its
    release leaves; ``None`` otherwise.
    """

    name: str
    environment: str
    holder: str
    purpose: str
    epoch: int
    token: UUID = field(repr=False)
    acquired_at: datetime
    expires_at: datetime
    hold_until: datetime
    ttl: float
    deadline: float
    sharer: str | None = None
    joined_at: datetime | None = None

    def remaining(self) -> float:
        """Seconds this holder may still trust the lease (negative once past its deadline)."""
        return self.deadline - time.monotonic()

    @property
    def trusted(self) -> bool:
        return self.remaining() > 0


@dataclass(frozen=True, kw_only=True)
class Acquisition:
    """The answer to :meth:`LeaseStore.acquire` and :meth:`LeaseStore.rejoin`. ``expires_in``
    is how many seconds the owner's lease had left by the database clock when the answer was
    given (negative once it expired), ``None`` when the answer did not tell: a figure no client
    clock, skewed or not, went into."""

    outcome: Outcome
    lease: Lease | None
    owner: Owner | None
    expires_in: float | None = None

    @property
    def acquired(self) -> bool:
        return self.lease is not None


@dataclass(frozen=True, kw_only=True)
class StaleRun:
    """A rejected renew, release, start or write by a holder whose epoch no longer held."""

    id: int
    recorded_at: datetime
    environment: str
    lease_name: str
    stale_epoch: int | None
    stale_holder: str
    current_epoch: int | None
    current_holder: str | None
    reason: str
    action: str
    enforced: bool


@dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """Who held one epoch of a lease, and how that epoch ended."""

    name: str
    epoch: int
    environment: str
    holder: str
    purpose: str
    acquired_at: datetime
    ended_at: datetime | None
    end_reason: str | None


@dataclass(frozen=True, kw_only=True)
class Dispatch:
    """One schedule slot a fenced scheduler dispatched, under which epoch."""

    schedule: str
    entry: str
    slot: datetime
    task: str
    epoch: int
    holder: str
    dispatched_at: datetime
