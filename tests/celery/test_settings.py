"""The ``fence_*`` settings and every fenced task's timings are checked once, at worker start.

Impossible values raise :class:`ConfigurationError` naming the key (or the task) before any
lease is taken; a worker with such a configuration does not start.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from celery import Celery
from sqlalchemy.engine import make_url

from celery_fence import ConfigurationError, LeaseStore, SchemaNotInstalledError
from celery_fence.contrib.celery import Fence, FenceSettings
from celery_fence.contrib.celery.beat import FencedScheduler

if TYPE_CHECKING:
    from conftest import StartWorker


def test_defaults_and_enforcement_per_environment() -> None:
    settings = FenceSettings.from_conf(
        {
            "fence_database_url": "postgresql://db/fence",
            "fence_enforcement": {"test": "enforce", "prod": "shadow", "*": "off"},
        }
    )

    assert settings.database_url == "postgresql://db/fence"
    assert (settings.environment, settings.default_ttl, settings.on_busy) == ("default", 30, "skip")
    assert (settings.renew_interval, settings.safety_margin, settings.busy_max_retries) == (
        None,
        0.1,
        10,
    )
    assert [settings.enforcement_for(env) for env in ("test", "prod", "dev")] == [
        "enforce",
        "shadow",
        "off",
    ]
    assert FenceSettings.from_conf({}).enforcement_for("prod") == "enforce"


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        pytest.param(
            {"fence_default_ttl": 10, "fence_renew_interval": 9},
            r"^fence_renew_interval 9s must be shorter than the 9s the holder trusts a 10s lease "
            r"\(fence_default_ttl less the 10% safety margin\)$",
            id="renew interval not below ttl less margin",
        ),
        pytest.param(
            {"fence_default_ttl": 10, "fence_safety_margin": 0.5, "fence_renew_interval": 6},
            r"fence_renew_interval 6s must be shorter than the 5s the holder trusts a 10s lease",
            id="renew interval past the safety margin",
        ),
        pytest.param(
            {"fence_beat_ttl": 15, "fence_beat_renew_interval": 15},
            r"^fence_beat_renew_interval 15s must be shorter",
            id="beat renew interval",
        ),
        pytest.param(
            {"fence_default_ttl": 30, "fence_safety_margin": 0.9},
            r"^the default renew interval \(a third of fence_default_ttl\) 10s must be shorter "
            r"than the 3s the holder trusts a 30s lease \(fence_default_ttl less the 90% safety "
            r"margin\)$",
            id="default renew interval past the safety margin",
        ),
        pytest.param(
            {"fence_renew_interval": 0},
            r"^fence_renew_interval must be greater than 0 seconds, got 0$",
            id="renew interval not positive",
        ),
        pytest.param(
            {"fence_renew_interval": "10s"},
            r"^fence_renew_interval must be a number of seconds, got '10s'$",
            id="renew interval not a number",
        ),
        pytest.param(
            {"fence_beat_renew_interval": 0},
            r"^fence_beat_renew_interval must be greater than 0 seconds, got 0$",
            id="beat renew interval not positive",
        ),
        pytest.param(
            {"fence_beat_renew_interval": 20},
            r"^fence_beat_renew_interval 20s must be shorter than the 13.5s the holder "
            r"trusts a 15s lease \(fence_beat_ttl less the 10% safety margin\)$",
            id="beat renew interval above the beat ttl",
        ),
        pytest.param(
            {"fence_default_ttl": 7200},
            r"^fence_default_ttl must be at most 3600 seconds \(the fence_max_ttl setting\), "
            r"got 7200$",
            id="ttl above max ttl",
        ),
        pytest.param(
            {"fence_max_ttl": 10, "fence_default_ttl": 5},
            r"^fence_beat_ttl must be at most 10 seconds \(the fence_max_ttl setting\), got 15.0$",
            id="beat ttl above max ttl",
        ),
        pytest.param(
            {"fence_max_hold": 10},
            r"fence_max_hold \(10s\) must be at least fence_default_ttl \(30s\)",
            id="max hold below ttl",
        ),
        pytest.param(
            {"fence_ttl": 30, "fence_on_busy": "skip"},
            r"unknown celery-fence setting\(s\): fence_ttl",
            id="unknown key",
        ),
        pytest.param(
            {"fence_on_busy": "wait"},
            r"fence_on_busy must be one of skip, retry, raise; got 'wait'",
            id="bad on_busy",
        ),
        pytest.param(
            {"fence_busy_max_retries": -1},
            r"fence_busy_max_retries must be a non-negative integer",
            id="negative max retries",
        ),
        pytest.param(
            {"fence_enforcement": "strict"},
            r"fence_enforcement must be one of enforce, shadow, off; got 'strict'",
            id="bad enforcement",
        ),
        pytest.param(
            {"fence_enforcement": {"prod": "block"}},
            r"fence_enforcement\['prod'\] must be one of enforce, shadow, off",
            id="bad enforcement for one environment",
        ),
        pytest.param(
            {"fence_enforcement": {" prod": "enforce"}},
            r"^fence_enforcement key ' prod' must not start or end with whitespace",
            id="bad environment in enforcement",
        ),
        pytest.param(
            {"fence_environment": ""},
            r"^fence_environment must not be empty$",
            id="empty environment",
        ),
        pytest.param(
            {"fence_beat_lease": ""},
            r"^fence_beat_lease must not be empty$",
            id="empty beat lease",
        ),
    ],
)
def test_impossible_settings_are_refused(conf: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        FenceSettings.from_conf(conf)


@pytest.mark.parametrize(
    ("conf", "task_options", "message"),
    [
        pytest.param(
            {},
            {"time_limit": 120, "max_hold": 60},
            r"time limit 120s exceeds the lease's maximum hold 60s",
            id="task time limit over its max hold",
        ),
        pytest.param(
            {"task_time_limit": 7200, "fence_max_hold": 3600},
            {},
            r"time limit 7200s exceeds the lease's maximum hold 3600s",
            id="app time limit over fence_max_hold",
        ),
        pytest.param(
            {},
            {"ttl": 6, "renew_interval": 6},
            r" renew_interval 6s must be shorter than the 5.4s the holder trusts a 6s lease "
            r"\(test_settings.publish ttl less",
            id="task renew interval",
        ),
        pytest.param(
            {"fence_max_ttl": 60},
            {"ttl": 120},
            r" ttl must be at most 60 seconds \(the fence_max_ttl setting\), got 120.0$",
            id="task ttl over fence_max_ttl",
        ),
        pytest.param(
            {"fence_max_ttl": 60},
            {"min_hold": 120},
            r" min_hold must be at most 60 seconds \(the fence_max_ttl setting\), got 120.0$",
            id="task min hold over fence_max_ttl",
        ),
        pytest.param(
            {"fence_max_hold": 45},
            {"ttl": 60},
            r": fence_max_hold \(45s\) must be at least the lease's ttl \(60s",
            id="task ttl over fence_max_hold",
        ),
        pytest.param(
            {},
            {"ttl": 20, "max_hold": 10},
            r"max_hold \(10s\) must be at least the lease's ttl \(20s",
            id="task ttl over its max hold",
        ),
        pytest.param(
            {"fence_max_hold": 45},
            {"min_hold": 120},
            r": fence_max_hold \(45s\) must be at least its min_hold \(120s",
            id="task min hold over fence_max_hold",
        ),
        pytest.param(
            {},
            {"min_hold": 3000, "max_hold": 1000},
            r" max_hold \(1000s\) must be at least its min_hold \(3000s",
            id="task min hold over its max hold",
        ),
        pytest.param(
            {},
            {"time_limit": 172800},
            r"time limit 172800s exceeds the lease's maximum hold 86400s \(the longer of its ttl",
            id="time limit over the default maximum hold of a day",
        ),
    ],
)
def test_impossible_task_timings_are_refused_at_startup(
    app: Celery, fence: Fence, conf: dict[str, Any], task_options: dict[str, Any], message: str
) -> None:
    app.conf.update(conf)

    @fence.task(lease="release:{environment}", **task_options)
    def publish(environment: str) -> None:
        """A task whose timings cannot work."""

    with pytest.raises(ConfigurationError, match=rf"{publish.name}.*{message}"):
        fence.check_startup()


def test_startup_check_passes_and_needs_the_schema(
    app: Celery, fence: Fence, empty_database_url: str
) -> None:
    @fence.task(lease="release:{environment}", ttl=60, max_hold=600, time_limit=300)
    def publish(environment: str) -> None:
        """Timings that work."""

    fence.check_startup()

    bare = Celery("no-schema", set_as_current=False)
    bare.conf.fence_database_url = empty_database_url
    unprepared = Fence(bare)
    try:
        with pytest.raises(SchemaNotInstalledError, match="celery-fence install"):
            unprepared.check_startup()
    finally:
        unprepared.store.engine.dispose()


APP_MODULE = """
from celery import Celery
from sqlalchemy.engine import make_url
from celery_fence.contrib.celery import Fence

app = Celery("refused", broker="memory://")
app.conf.fence_database_url = {url!r}
app.conf.fence_default_ttl = {ttl}
fence = Fence(app)


@fence.task(lease="job")
def job():
    pass
"""


def run_refused(
    directory: Path, url: str, ttl: int, *arguments: str
) -> subprocess.CompletedProcess[str]:
    """Run Python with ``arguments`` in ``directory``, where module ``refused`` holds an app on
    ``url`` with ``fence_default_ttl`` ``ttl``; it must exit with status 1."""
    (directory / "refused.py").write_text(APP_MODULE.format(url=url, ttl=ttl))
    result = subprocess.run(
        [sys.executable, *arguments],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    return result


@pytest.mark.parametrize(
    "command",
    [
        ["worker", "-P", "solo"],
        ["beat", "-S", "fence"],
        ["-q", "worker", "-P", "solo"],
        ["-q", "beat", "-S", "fence"],
        ["-q", "beat", "-S", "fence", "--logfile", "beat.log"],
    ],
)
@pytest.mark.parametrize(
    ("ttl", "schema", "said"),
    [
        (30, False, "celery-fence schema is not installed or out of date"),
        (0, True, "fence_default_ttl must be greater than 0 seconds, got 0"),
    ],
    ids=["no schema", "bad setting"],
)
def test_celery_worker_and_beat_refuse_to_start_in_one_line(
    tmp_path: Path,
    empty_database_url: str,
    command: list[str],
    ttl: int,
    schema: bool,
    said: str,
) -> None:
    """`celery worker` and `celery beat` that celery-fence keeps from starting say why in one
    line and exit 1, as for a mistyped option, without a traceback. Quiet (`celery -q`), beat
    makes its scheduler only once its output goes to its log: the line is a log line there, in
    its --logfile when it has one."""
    if schema:
        store = LeaseStore.from_url(empty_database_url)
        store.install()
        store.dispose()
    result = run_refused(
        tmp_path, empty_database_url, ttl, "-m", "celery", "-A", "refused", *command
    )
    logged = tmp_path / "beat.log"
    output = result.stderr + (logged.read_text() if "--logfile" in command else "")
    assert "Traceback" not in output
    [name] = [word for word in command if word in ("worker", "beat")]
    [line] = [line for line in output.splitlines() if f"{name} not started: " in line]
    if command[:2] == ["-q", "beat"]:
        assert re.fullmatch(
            rf"\[[^]]+: CRITICAL/MainProcess\] beat not started: {re.escape(said)}.*", line
        )
    else:
        assert line.startswith(f"Error: {name} not started: {said}")
    # Which database has no schema: its URL, password hidden.
    database = make_url(empty_database_url).set(drivername="postgresql+psycopg")
    assert line.endswith(f" [database {database.render_as_string()}]") != schema
    assert (result.stderr == "") == ("--logfile" in command)


#: A database no server answers at, with a password in the URL and in its parameters.
UNREACHABLE = "postgresql://postgres:s3cret@127.0.0.1:1/app?password=s3cret&connect_timeout=2"


def test_a_worker_refuses_to_start_without_its_database_naming_it_and_a_beat_stands_by(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose database does not answer when it starts exits 1, saying which database
    (without its password); a beat starts on standby and takes the lease once it answers."""
    result = run_refused(
        tmp_path, UNREACHABLE, 30, "-m", "celery", "-A", "refused", "worker", "-P", "solo"
    )
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "worker not started: " in line]
    assert line.startswith("Error: worker not started: database error: connection failed: ")
    assert line.endswith(
        " [database postgresql+psycopg://postgres:***@127.0.0.1:1/app"
        "?connect_timeout=2&password=***]"
    )
    assert "s3cret" not in result.stderr

    app = Celery("beat-unreachable", set_as_current=False)
    app.conf.update(broker_url="memory://", fence_database_url=UNREACHABLE)
    caplog.set_level(logging.WARNING, "celery_fence")
    beat = FencedScheduler(app=app, lazy=False)
    try:
        assert (beat.lease, beat.halted) == (None, None)
        assert f"beat on standby for {beat.lease_name}: database unavailable: " in caplog.text
    finally:
        beat.close()
        app.close()


def test_a_worker_started_from_python_refuses_to_start_in_one_line(
    tmp_path: Path, empty_database_url: str
) -> None:
    """``app.worker_main()``, Celery's command called from a script, refuses as the command does:
    one line, exit status 1, no traceback."""
    script = "import refused; refused.app.worker_main(['worker', '-P', 'solo'])"
    result = run_refused(tmp_path, empty_database_url, 0, "-c", script)
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "Error: worker not started: fence_default_ttl must be greater than 0 seconds, got 0"
    )


def test_embedded_worker_refuses_to_start_with_impossible_timings(
    app: Celery, fence: Fence, worker: StartWorker
) -> None:
    app.conf.update(fence_default_ttl=10, fence_renew_interval=9.5)

    @fence.task(lease="release:{environment}")
    def publish(environment: str) -> None:
        """Never runs: the worker does not start."""

    refused = pytest.raises(ConfigurationError, match=r"fence_renew_interval 9.5s must be shorter")
    with refused, worker():
        pytest.fail("the worker started")


def test_a_worker_time_limit_over_a_tasks_max_hold_is_refused_at_startup(
    app: Celery, fence: Fence, worker: StartWorker
) -> None:
    @fence.task(lease="release:{environment}", max_hold=3600)
    def publish(environment: str) -> None:
        """Never runs: the worker does not start."""

    # celery worker --time-limit=7200, not task_time_limit.
    refused = pytest.raises(
        ConfigurationError, match=r"time limit 7200s exceeds the lease's maximum hold 3600s"
    )
    with refused, worker(time_limit=7200):
        pytest.fail("the worker started")


@pytest.mark.parametrize("key", ["FENCE_ENFORCEMENT", "Fence_default_ttl"])
def test_a_key_in_another_case_is_refused_not_ignored(key: str) -> None:
    """Celery reads the lowercase keys only: ``FENCE_ENFORCEMENT = "shadow"`` would otherwise
    leave enforcement on with nothing said."""
    app = Celery("cased", set_as_current=False)
    app.config_from_object(type("Cased", (), {key: "shadow", "broker_url": "memory://"}))
    with pytest.raises(ConfigurationError, match=rf"unknown celery-fence setting\(s\): {key}$"):
        Fence(app).check_startup()


@pytest.mark.parametrize("namespace", [None, "CELERY"])
def test_a_projects_own_key_that_begins_with_fence_is_left_alone(namespace: str | None) -> None:
    app = Celery("project", set_as_current=False)
    app.config_from_object(
        type("Project", (), {"FENCE_API_URL": "https://fence.example", "broker_url": "memory://"}),
        namespace=namespace,
    )
    assert Fence(app).settings.enforcement == {}


class DjangoSettings:
    """A Django settings module, read with ``namespace="CELERY"``."""

    CELERY_BROKER_URL = "memory://"
    CELERY_FENCE_DATABASE_URL = "postgresql://db/fence"
    CELERY_FENCE_ENVIRONMENT = "prod"
    DEBUG = False


@pytest.mark.parametrize("key", ["CELERY_FENCE_ENFORCMENT", "celery_fence_enforcement"])
def test_keys_under_a_configuration_namespace_are_read_and_checked(key: str) -> None:
    app = Celery("django-style", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    settings = Fence(app).settings
    assert (settings.database_url, settings.environment) == ("postgresql://db/fence", "prod")

    app = Celery("django-style", set_as_current=False)
    app.config_from_object(type("Misspelt", (DjangoSettings,), {key: "shadow"}), namespace="CELERY")
    with pytest.raises(ConfigurationError, match=rf"unknown celery-fence setting\(s\): {key}$"):
        Fence(app).check_startup()
