"""Logging and counting: every rejection is logged under ``celery_fence.*`` and counted."""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("celery_fence")
stale_log = logging.getLogger("celery_fence.stale")


class Metrics:
    """Thread-safe event counters, e.g. ``acquire.acquired``, ``acquire.held``,
    ``rejected.superseded``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def incr(self, event: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[event] += amount

    def get(self, event: str) -> int:
        with self._lock:
            return self._counts[event]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
