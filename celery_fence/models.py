"""Frozen value objects: leases, owners, acquisitions, stale-run and history records."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal
from uuid import UUID

Outcome = Literal["acquired", "held", "busy", "paused", "joined", "resumed"]
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


@dataclass(frozen=True, kw_only=True)
class Lease:
    """A lease this process holds: the epoch is its fencing token, the token its secret.

    ``deadline`` is a ``time.monotonic()`` value taken before the request that granted the lease
    was sent, plus the time the database granted, less a safety margin: past it, the holder
    stops trusting the lease even if the database has not yet handed it on.
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

    def remaining(self) -> float:
        """Seconds this holder may still trust the lease (negative once past its deadline)."""
        return self.deadline - time.monotonic()

    @property
    def trusted(self) -> bool:
        return self.remaining() > 0


@dataclass(frozen=True, kw_only=True)
class Acquisition:
    """The answer to :meth:`LeaseStore.acquire`."""

    outcome: Outcome
    lease: Lease | None
    owner: Owner | None

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
