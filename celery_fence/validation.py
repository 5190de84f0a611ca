"""Input checks that run before any SQL, so bad input never reaches the database."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime

from celery_fence.exceptions import ConfigurationError

MAX_NAME_LENGTH = 200
MAX_ENVIRONMENT_LENGTH = 64
MAX_TEXT_LENGTH = 500
#: The longest schedule entry name: ``claim_slot``'s action, ``dispatch <entry> for <slot>``, names
#: it whole within the longest action, with the longest time a slot has (microseconds and an
#: offset, 32 characters).
MAX_ENTRY_LENGTH = MAX_TEXT_LENGTH - len("dispatch  for ") - 32
MAX_TTL_SECONDS = 86_400.0
MAX_HOLD_SECONDS = 7 * 86_400.0
#: The longest a protocol call may wait behind fenced writers (a store's ``lock_timeout``).
MAX_LOCK_TIMEOUT_SECONDS = 60.0
#: The maximum hold of a lease acquired without one is the longer of its TTL and this (the
#: default of ``celery_fence.acquire``).
DEFAULT_MAX_HOLD_SECONDS = 86_400.0
#: The shortest span of seconds: PostgreSQL keeps times and intervals to the microsecond.
RESOLUTION_SECONDS = 1e-6
#: The most rows one listing returns.
MAX_LIMIT = 10_000
#: The largest epoch: epochs are PostgreSQL ``bigint``s.
MAX_EPOCH = 2**63 - 1


def check_text(value: object, what: str, *, max_length: int, allow_empty: bool = False) -> str:
    """Return ``value`` if it is printable text of an allowed length, else raise."""
    if not isinstance(value, str):
        raise ConfigurationError(f"{what} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise ConfigurationError(f"{what} must not be empty")
    if len(value) > max_length:
        raise ConfigurationError(
            f"{what} must be at most {max_length} characters, got {len(value)}"
        )
    if not value.isprintable():
        raise ConfigurationError(f"{what} must be printable text, got {value!r}")
    if value != value.strip():
        raise ConfigurationError(f"{what} must not start or end with whitespace, got {value!r}")
    return value


def check_name(value: object, what: str = "lease name") -> str:
    return check_text(value, what, max_length=MAX_NAME_LENGTH)


def check_holder(value: object, what: str = "holder") -> str:
    return check_text(value, what, max_length=MAX_NAME_LENGTH)


def check_entry(value: object) -> str:
    """Return ``value`` if it can name a schedule entry (see :data:`MAX_ENTRY_LENGTH`)."""
    return check_text(value, "entry", max_length=MAX_ENTRY_LENGTH)


def check_environment(value: object, what: str = "environment") -> str:
    return check_text(value, what, max_length=MAX_ENVIRONMENT_LENGTH)


def check_epoch(value: object) -> int:
    """Return ``value`` if it is an integer epoch, from 1 to :data:`MAX_EPOCH`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_EPOCH:
        raise ConfigurationError(f"epoch must be an integer from 1 to {MAX_EPOCH}, got {value!r}")
    return value


def check_aware(value: object, what: str) -> datetime:
    """Return ``value`` if it is a timezone-aware ``datetime``."""
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise ConfigurationError(f"{what} must be a timezone-aware datetime, got {value!r}")
    return value


def check_flag(value: object, what: str) -> bool:
    """Return ``value`` if it is a bool: 0, 1 and ``"no"`` are refused, not taken for one."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{what} must be True or False, got {value!r}")
    return value


def check_choice(value: object, what: str, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigurationError(f"{what} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_seconds(value: object, what: str, *, maximum: float, limit: str | None = None) -> float:
    """Return ``value`` as float seconds if finite and within ``(0, maximum]``. ``limit``
    names the setting ``maximum`` comes from, for the error to say where to raise it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{what} must be a number of seconds, got {value!r}")
    source = "" if limit is None else f" (the {limit} setting)"
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond any float (its repr may be too long to print)
        raise ConfigurationError(
            f"{what} must be from 0 to {maximum:g} seconds{source}, got an integer beyond any float"
        ) from None
    if not math.isfinite(seconds):
        raise ConfigurationError(f"{what} must be finite, got {value!r}")
    if seconds <= 0:
        raise ConfigurationError(f"{what} must be greater than 0 seconds, got {value!r}")
    if seconds < RESOLUTION_SECONDS:
        # The database keeps microseconds: a shorter span would reach it as zero.
        raise ConfigurationError(f"{what} must be at least a microsecond, got {value!r}")
    if seconds > maximum:
        raise ConfigurationError(
            f"{what} must be at most {maximum:g} seconds{source}, got {value!r}"
        )
    return seconds


def check_lock_timeout(value: object, what: str) -> float:
    """Return ``value`` as the seconds a call may wait for a lock (at most
    :data:`MAX_LOCK_TIMEOUT_SECONDS`)."""
    return check_seconds(value, what, maximum=MAX_LOCK_TIMEOUT_SECONDS)


def check_seconds_or_zero(value: object, what: str, *, maximum: float) -> float:
    """Return ``value`` as float seconds if it is ``0`` (none) or as :func:`check_seconds`
    takes it."""
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        if value == 0:
            return 0.0
        if value < 0:
            raise ConfigurationError(f"{what} must be 0 or more seconds, got {value!r}")
    return check_seconds(value, what, maximum=maximum)


def check_max_hold(
    value: object, ttl: float, *, what: str = "max_hold", ttl_what: str = "ttl"
) -> float:
    """Return ``value`` as the seconds a lease may be held in all: at most
    :data:`MAX_HOLD_SECONDS`, and at least ``ttl``, which the database would refuse otherwise."""
    seconds = check_seconds(value, what, maximum=MAX_HOLD_SECONDS)
    if seconds < ttl:
        raise ConfigurationError(f"{what} ({seconds:g}s) must be at least {ttl_what} ({ttl:g}s)")
    return seconds


def readable(check: Callable[[object], str], value: object) -> str | None:
    """``value`` as ``check`` returns it, or None when ``check`` refuses it: for recording what
    could be read of an input that is rejected anyway, or leaving out one that would be."""
    try:
        return check(value)
    except ConfigurationError:
        return None


def check_fraction(value: object, what: str) -> float:
    """Return ``value`` if it is a number in ``[0, 1)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigurationError(f"{what} must be a number in [0, 1), got {value!r}")
    return float(value)
