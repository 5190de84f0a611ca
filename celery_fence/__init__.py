"""celery-fence: PostgreSQL leases and fencing tokens for Celery.

The core (this package, less ``contrib``) imports neither Celery nor a driver-specific API.
"""

from celery_fence.exceptions import (
    ConfigurationError,
    FenceDatabaseError,
    FenceError,
    LeaseBusyError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    LeasePausedError,
    SchemaNotInstalledError,
    StaleEpochError,
)
from celery_fence.models import Acquisition, Dispatch, HistoryEntry, Lease, Owner, StaleRun
from celery_fence.store import LeaseStore, engine_from_url

__all__ = [
    "Acquisition",
    "ConfigurationError",
    "Dispatch",
    "FenceDatabaseError",
    "FenceError",
    "HistoryEntry",
    "Lease",
    "LeaseBusyError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "LeasePausedError",
    "LeaseStore",
    "Owner",
    "SchemaNotInstalledError",
    "StaleEpochError",
    "StaleRun",
    "engine_from_url",
]
