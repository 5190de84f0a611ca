"""The ``celery_fence`` message header: which lease and epoch a task was published under.

The header carries the lease name, epoch, holder, mode and a proof: HMAC-SHA256 keyed by the
lease's secret token over those fields. The token itself never travels; the worker checks the
proof in the database (``celery_fence.rejoin``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_fence import validation
from celery_fence.exceptions import ConfigurationError
from celery_fence.models import Lease
from celery_fence.store import Mode, proof

HEADER = "celery_fence"
_PROOF = re.compile(r"^[0-9a-f]{64}$")


class MalformedHeaderError(ConfigurationError):
    """A ``celery_fence`` header that cannot be read; ``lease_name`` is what could be read."""

    def __init__(self, message: str, *, lease_name: str | None, holder: str | None) -> None:
        super().__init__(message)
        self.lease_name = lease_name
        self.holder = holder


@dataclass(frozen=True, kw_only=True)
class FenceHeader:
    lease: str
    epoch: int
    holder: str
    mode: Mode
    proof: str

    @classmethod
    def for_lease(cls, lease: Lease, mode: Mode) -> FenceHeader:
        return cls(
            lease=lease.name,
            epoch=lease.epoch,
            holder=lease.holder,
            mode=mode,
            proof=proof(lease, mode),
        )

    def to_message(self) -> dict[str, Any]:
        return {
            "lease": self.lease,
            "epoch": self.epoch,
            "holder": self.holder,
            "mode": self.mode,
            "proof": self.proof,
        }

    @classmethod
    def from_message(cls, value: object) -> FenceHeader:
        """Parse a header; raise :class:`MalformedHeaderError` on anything unexpected."""
        if not isinstance(value, Mapping):
            raise MalformedHeaderError(
                f"{HEADER} header must be a mapping, got {type(value).__name__}",
                lease_name=None,
                holder=None,
            )
        lease = value.get("lease")
        holder = value.get("holder")
        readable_lease = lease if isinstance(lease, str) and lease.isprintable() else None
        readable_holder = holder if isinstance(holder, str) and holder.isprintable() else None
        try:
            epoch = value.get("epoch")
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
                raise ConfigurationError(f"epoch must be a positive integer, got {epoch!r}")
            mode = value.get("mode")
            if mode not in ("join", "resume"):
                raise ConfigurationError(f"mode must be join or resume, got {mode!r}")
            digest = value.get("proof")
            if not isinstance(digest, str) or not _PROOF.match(digest):
                raise ConfigurationError("proof must be 64 lowercase hex digits")
            return cls(
                lease=validation.check_name(lease),
                epoch=epoch,
                holder=validation.check_holder(holder),
                mode=mode,
                proof=digest,
            )
        except ConfigurationError as exc:
            raise MalformedHeaderError(
                f"malformed {HEADER} header: {exc}",
                lease_name=readable_lease,
                holder=readable_holder,
            ) from exc
