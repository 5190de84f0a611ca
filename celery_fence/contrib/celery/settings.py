"""The ``fence_*`` keys of a Celery app's configuration, validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from celery.utils.text import match_case

from celery_fence import validation
from celery_fence.exceptions import ConfigurationError

Enforcement = Literal["enforce", "shadow", "off"]
OnBusy = Literal["skip", "retry", "raise"]
ENFORCEMENT_MODES: tuple[Enforcement, ...] = ("enforce", "shadow", "off")
ON_BUSY: tuple[OnBusy, ...] = ("skip", "retry", "raise")

#: Every key and its default; docs/reference/configuration.md lists the same and what each means.
DEFAULTS: dict[str, Any] = {
    "fence_database_url": None,
    "fence_environment": "default",
    "fence_enforcement": "enforce",
    "fence_default_ttl": 30.0,
    "fence_renew_interval": None,
    "fence_max_ttl": 3600.0,
    "fence_max_hold": None,
    "fence_lock_timeout": 2.0,
    "fence_safety_margin": 0.1,
    "fence_on_busy": "skip",
    "fence_busy_max_retries": 10,
    "fence_beat_lease": None,
    "fence_beat_ttl": 15.0,
    "fence_beat_renew_interval": None,
    "fence_beat_max_hold": validation.MAX_HOLD_SECONDS,
}


def check_timing(
    ttl: float,
    renew_interval: float | None,
    safety_margin: float,
    *,
    ttl_name: str,
    interval_name: str,
) -> float:
    """The renew interval (default a third of the TTL) must leave time to renew before the
    holder's own deadline (the TTL less the safety margin); return it. Errors name the TTL
    ``ttl_name`` and a given interval ``interval_name``, the settings they come from."""
    if renew_interval is None:
        interval, named = ttl / 3, f"the default renew interval (a third of {ttl_name})"
    else:
        interval, named = renew_interval, interval_name
    # Any interval up to the longest TTL is checked against the trust below, which is the bound
    # that matters: one message, naming it, rather than "at most the TTL" and then this one.
    interval = validation.check_seconds(interval, named, maximum=validation.MAX_TTL_SECONDS)
    trusted = ttl * (1 - safety_margin)
    if interval >= trusted:
        raise ConfigurationError(
            f"{named} {interval:g}s must be shorter than the {trusted:g}s the holder trusts a "
            f"{ttl:g}s lease ({ttl_name} less the {safety_margin:.0%} safety margin)"
        )
    return interval


def _unknown_key(key: str, namespace: str | None) -> bool:
    """Whether ``key`` is meant for celery-fence but is none of its keys as Celery looks them
    up: ``fence_x``, and under a namespace also ``CELERY_FENCE_X`` (in the namespace's case).
    One of its keys in another case (``FENCE_ENFORCEMENT``) is meant for it too, and would never
    be read; another key so spelt (a Django project's ``FENCE_API_URL``) is not its own."""
    if key in DEFAULTS:
        return False
    if namespace:
        prefix = namespace.rstrip("_") + "_"
        if key.lower().startswith(prefix.lower()) and key[len(prefix) :].lower().startswith(
            "fence_"
        ):
            name = key[len(prefix) :].lower()
            return name not in DEFAULTS or key != match_case(prefix + name, prefix)
    return key.startswith("fence_") or key.lower() in DEFAULTS


@dataclass(frozen=True, kw_only=True)
class FenceSettings:
    """What celery-fence reads from ``app.conf``; see the configuration reference."""

    database_url: str | None
    environment: str
    enforcement: Mapping[str, Enforcement] = field(default_factory=dict)
    default_enforcement: Enforcement = "enforce"
    default_ttl: float
    renew_interval: float | None
    max_ttl: float
    max_hold: float | None
    lock_timeout: float
    safety_margin: float
    on_busy: OnBusy
    busy_max_retries: int
    beat_lease: str | None
    beat_ttl: float
    beat_renew_interval: float
    beat_max_hold: float

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any], namespace: str | None = None) -> FenceSettings:
        """Read and validate every ``fence_*`` key; raise :class:`ConfigurationError` on the
        first impossible value, naming the key. ``namespace`` is the app's configuration
        namespace (``app.config_from_object(..., namespace="CELERY")``), under which the keys
        are spelt ``CELERY_FENCE_...``."""

        def get(key: str) -> Any:
            value = conf.get(key)
            return DEFAULTS[key] if value is None else value

        unknown = sorted(k for k in conf if _unknown_key(k, namespace))
        if unknown:
            raise ConfigurationError(f"unknown celery-fence setting(s): {', '.join(unknown)}")
        max_ttl = validation.check_seconds(
            get("fence_max_ttl"), "fence_max_ttl", maximum=validation.MAX_TTL_SECONDS
        )
        safety_margin = validation.check_fraction(get("fence_safety_margin"), "fence_safety_margin")
        default_ttl = validation.check_seconds(
            get("fence_default_ttl"), "fence_default_ttl", maximum=max_ttl, limit="fence_max_ttl"
        )
        max_hold = get("fence_max_hold")
        if max_hold is not None:
            max_hold = validation.check_max_hold(
                max_hold, default_ttl, what="fence_max_hold", ttl_what="fence_default_ttl"
            )
        renew_interval = get("fence_renew_interval")
        check_timing(
            default_ttl,
            renew_interval,
            safety_margin,
            ttl_name="fence_default_ttl",
            interval_name="fence_renew_interval",
        )
        beat_ttl = validation.check_seconds(
            get("fence_beat_ttl"), "fence_beat_ttl", maximum=max_ttl, limit="fence_max_ttl"
        )
        beat_renew = check_timing(
            beat_ttl,
            get("fence_beat_renew_interval"),
            safety_margin,
            ttl_name="fence_beat_ttl",
            interval_name="fence_beat_renew_interval",
        )
        beat_max_hold = validation.check_max_hold(
            get("fence_beat_max_hold"),
            beat_ttl,
            what="fence_beat_max_hold",
            ttl_what="fence_beat_ttl",
        )
        retries = get("fence_busy_max_retries")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(
                f"fence_busy_max_retries must be a non-negative integer, got {retries!r}"
            )
        enforcement_conf = get("fence_enforcement")
        if isinstance(enforcement_conf, str):
            default = validation.check_choice(
                enforcement_conf, "fence_enforcement", ENFORCEMENT_MODES
            )
            per_environment: dict[str, Enforcement] = {}
        elif isinstance(enforcement_conf, Mapping):
            default = validation.check_choice(
                enforcement_conf.get("*", "enforce"), "fence_enforcement['*']", ENFORCEMENT_MODES
            )
            per_environment = {
                validation.check_environment(env, f"fence_enforcement key {env!r}"): cast(
                    Enforcement,
                    validation.check_choice(mode, f"fence_enforcement[{env!r}]", ENFORCEMENT_MODES),
                )
                for env, mode in enforcement_conf.items()
                if env != "*"
            }
        else:
            raise ConfigurationError(
                "fence_enforcement must be a mode (enforce, shadow, off) or a mapping of "
                f"environment to mode, got {enforcement_conf!r}"
            )
        beat_lease = get("fence_beat_lease")
        database_url = get("fence_database_url")
        if database_url is not None and not isinstance(database_url, str):
            raise ConfigurationError("fence_database_url must be a database URL string")
        return cls(
            database_url=database_url,
            environment=validation.check_environment(get("fence_environment"), "fence_environment"),
            enforcement=per_environment,
            default_enforcement=cast(Enforcement, default),
            default_ttl=default_ttl,
            renew_interval=renew_interval,
            max_ttl=max_ttl,
            max_hold=max_hold,
            lock_timeout=validation.check_lock_timeout(
                get("fence_lock_timeout"), "fence_lock_timeout"
            ),
            safety_margin=safety_margin,
            on_busy=cast(
                OnBusy, validation.check_choice(get("fence_on_busy"), "fence_on_busy", ON_BUSY)
            ),
            busy_max_retries=retries,
            beat_lease=(
                None
                if beat_lease is None
                else validation.check_name(beat_lease, "fence_beat_lease")
            ),
            beat_ttl=beat_ttl,
            beat_renew_interval=beat_renew,
            beat_max_hold=beat_max_hold,
        )

    def enforcement_for(self, environment: str) -> Enforcement:
        return self.enforcement.get(environment, self.default_enforcement)
