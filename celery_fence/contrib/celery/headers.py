"""The ``celery_fence`` message header: which lease and epoch a task was published under.

The header carries the lease name, epoch, holder, mode and a proof: HMAC-SHA256 keyed by the
lease's secret token over those fields. The token itself never travels; the worker checks the
proof in the database (``celery_fence.rejoin``). A header published from a run also carries a
``publication`` id, new for each message sent, which tells a redelivery of that message from
another message of the same task id (a retry). A header published from a run on one lease
that was itself published under others (a chain link after a step on another lease) also carries
those leases' entries, ``outer``: a later step on one of them continues under it, not anew.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast, get_args

from celery_fence import validation
from celery_fence.exceptions import ConfigurationError
from celery_fence.models import Lease
from celery_fence.observe import log
from celery_fence.store import Mode, proof

HEADER = "celery_fence"
_PROOF = re.compile("[0-9a-f]{64}")
_PUBLICATION = re.compile("[0-9a-f]{32}")
#: At most this many other leases' entries travel in one header (``outer``).
MAX_OUTER = 16
_ENTRY_FIELDS = frozenset({"lease", "epoch", "holder", "mode", "proof"})


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
    publication: str | None = None
    #: The ``resume`` entries of the other leases the publisher ran under, nearest first.
    outer: tuple[FenceHeader, ...] = ()

    @classmethod
    def for_lease(
        cls, lease: Lease, mode: Mode, outer: tuple[FenceHeader, ...] = ()
    ) -> FenceHeader:
        return cls(
            lease=lease.name,
            epoch=lease.epoch,
            holder=lease.holder,
            mode=mode,
            proof=proof(lease, mode),
            outer=outer,
        )

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "lease": self.lease,
            "epoch": self.epoch,
            "holder": self.holder,
            "mode": self.mode,
            "proof": self.proof,
        }
        if self.publication is not None:
            message["publication"] = self.publication
        if self.outer:
            message["outer"] = [entry.to_message() for entry in self.outer]
        return message

    def entry_for(self, lease: str) -> FenceHeader | None:
        """The ``resume`` entry this header carries for ``lease``: its own or an outer one."""
        if self.lease == lease:
            return self if self.mode == "resume" else None
        return next((entry for entry in self.outer if entry.lease == lease), None)

    def passed_on(self, lease: str) -> tuple[FenceHeader, ...]:
        """The entries a run on ``lease`` that received this header passes on as ``outer``: the
        ``resume`` entries of every other lease, nearest first, the :data:`MAX_OUTER` nearest
        (the farther are dropped, logged: a later step on one of their leases takes it anew)."""
        own = (replace(self, publication=None, outer=()),) if self.mode == "resume" else ()
        entries = tuple(entry for entry in own + self.outer if entry.lease != lease)
        if len(entries) > MAX_OUTER:
            log.warning(
                "a run on lease %s passes on the headers of the %d nearest of %d other leases; "
                "dropped: %s",
                lease,
                MAX_OUTER,
                len(entries),
                ", ".join(entry.lease for entry in entries[MAX_OUTER:]),
                extra={"lease": lease},
            )
        return entries[:MAX_OUTER]

    @classmethod
    def from_message(cls, value: object) -> FenceHeader:
        """Parse a header; raise :class:`MalformedHeaderError` on anything unexpected."""
        if not isinstance(value, Mapping):
            raise MalformedHeaderError(
                f"{HEADER} header must be a mapping, got {type(value).__name__}",
                lease_name=None,
                holder=None,
            )
        try:
            header = cls._entry(value)
            return replace(
                header,
                publication=_check_publication(value.get("publication")),
                outer=_check_outer(value.get("outer"), header),
            )
        except ConfigurationError as exc:
            # What can be read is recorded with the rejection; anything a lease name or holder
            # may not be is recorded as unreadable.
            raise MalformedHeaderError(
                f"malformed {HEADER} header: {exc}",
                lease_name=validation.readable(validation.check_name, value.get("lease")),
                holder=validation.readable(validation.check_holder, value.get("holder")),
            ) from exc

    @classmethod
    def _entry(cls, value: Mapping[str, Any]) -> FenceHeader:
        return cls(
            lease=validation.check_name(value.get("lease")),
            epoch=validation.check_epoch(value.get("epoch")),
            holder=validation.check_holder(value.get("holder")),
            mode=cast(Mode, validation.check_choice(value.get("mode"), "mode", get_args(Mode))),
            proof=_check_proof(value.get("proof")),
        )


def _check_outer(value: object, header: FenceHeader) -> tuple[FenceHeader, ...]:
    """The ``outer`` entries: ``resume`` ones, each of another lease, at most MAX_OUTER."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or len(value) > MAX_OUTER:
        raise ConfigurationError(f"outer must be a list of at most {MAX_OUTER} entries")
    entries = []
    leases = {header.lease}
    for item in value:
        if not isinstance(item, Mapping) or set(item) - _ENTRY_FIELDS:
            raise ConfigurationError(f"each outer entry has the fields {sorted(_ENTRY_FIELDS)}")
        entry = FenceHeader._entry(item)
        if entry.mode != "resume" or entry.lease in leases:
            raise ConfigurationError("outer entries are resume entries, each of a lease of its own")
        leases.add(entry.lease)
        entries.append(entry)
    return tuple(entries)


def _check_proof(value: object) -> str:
    if not isinstance(value, str) or not _PROOF.fullmatch(value):
        raise ConfigurationError("proof must be 64 lowercase hex digits")
    return value


def _check_publication(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not _PUBLICATION.fullmatch(value)):
        raise ConfigurationError("publication must be 32 lowercase hex digits")
    return value


def published(message: Mapping[str, Any]) -> dict[str, Any]:
    """A header's fields (``message``) as a new message carries them: with a publication id of
    its own, which its redeliveries keep."""
    return {**message, "publication": uuid.uuid4().hex}


def publication_of(value: object) -> str | None:
    """The publication id of header ``value``, if it has a well-formed one."""
    if not isinstance(value, Mapping):
        return None
    try:
        return _check_publication(value.get("publication"))
    except ConfigurationError:
        return None
