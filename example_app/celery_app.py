"""The example's Celery app, configured from environment variables.

``CELERY_FENCE_DATABASE_URL`` (required) is the PostgreSQL database that holds both the
celery-fence schema and the app's own tables: fenced writes must share a database with the
lease they are fenced by. ``CELERY_FENCE_BROKER_URL`` is the broker (default Redis on
127.0.0.1); for ``filesystem://`` ``CELERY_FENCE_BROKER_FOLDER`` names the shared folder.
``CELERY_FENCE_RESULT_BACKEND`` is optional. Every other ``fence_*`` key has a variable of
its own: ``fence_beat_ttl`` is read from ``CELERY_FENCE_BEAT_TTL``, and so on (numbers and
JSON objects are parsed, anything else is kept as text). ``EXAMPLE_APP_PLAN_EVERY`` is the
retention planner's period and ``EXAMPLE_APP_MIGRATE_SECONDS`` how long a release's
"migration" takes, both in seconds; ``EXAMPLE_APP_QUEUE`` is the queue tasks go to (default
``celery``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery

from celery_fence.contrib.celery import Fence
from celery_fence.contrib.celery.settings import DEFAULTS

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PLAN_EVERY = 10.0
DEFAULT_MIGRATE_SECONDS = 1.0

#: The variable for each ``fence_*`` key: ``fence_beat_ttl`` <- ``CELERY_FENCE_BEAT_TTL``.
FENCE_VARIABLES = {f"CELERY_FENCE_{key.removeprefix('fence_').upper()}": key for key in DEFAULTS}
#: Variables without which a worker or beat cannot start.
REQUIRED_VARIABLES = ("CELERY_FENCE_DATABASE_URL",)


def parse_value(raw: str) -> Any:
    """A number or a JSON object (``{"*": "shadow"}``) as such; any other text as it is."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, (int, float, dict)) and not isinstance(value, bool) else raw


def transport_options(broker_url: str, folder: str | None) -> dict[str, Any]:
    """The filesystem broker needs one folder that every process shares; it is polled, so
    poll often. Other brokers need nothing."""
    if not broker_url.startswith("filesystem://"):
        return {}
    if not folder:
        raise ValueError("a filesystem:// broker needs CELERY_FENCE_BROKER_FOLDER")
    messages = str(Path(folder) / "messages")
    return {
        "data_folder_in": messages,
        "data_folder_out": messages,
        "control_folder": str(Path(folder) / "control"),
        "polling_interval": 0.1,
    }


def config_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The app's configuration from ``environ``; see the module docstring for each variable."""
    broker_url = environ.get("CELERY_FENCE_BROKER_URL", DEFAULT_BROKER_URL)
    plan_every = float(environ.get("EXAMPLE_APP_PLAN_EVERY", DEFAULT_PLAN_EVERY))
    conf: dict[str, Any] = {
        "broker_url": broker_url,
        # filesystem://: kombu's transport, with whole-message writes (see example_app.broker).
        "broker_transport": (
            "example_app.broker:Transport" if broker_url.startswith("filesystem://") else None
        ),
        "broker_transport_options": transport_options(
            broker_url, environ.get("CELERY_FENCE_BROKER_FOLDER")
        ),
        "broker_connection_retry_on_startup": True,
        "result_backend": environ.get("CELERY_FENCE_RESULT_BACKEND"),
        "task_default_queue": environ.get("EXAMPLE_APP_QUEUE", "celery"),
        "worker_prefetch_multiplier": 1,
        "example_migrate_seconds": float(
            environ.get("EXAMPLE_APP_MIGRATE_SECONDS", DEFAULT_MIGRATE_SECONDS)
        ),
        "beat_schedule": {
            "plan-retention": {
                "task": "example_app.tasks.plan_retention",
                "schedule": plan_every,
            },
        },
    }
    for variable, key in FENCE_VARIABLES.items():
        if variable in environ:
            conf[key] = parse_value(environ[variable])
    return conf


app = Celery("example_app", include=["example_app.tasks"])
app.conf.update(config_from_env(os.environ))
fence = Fence(app)
