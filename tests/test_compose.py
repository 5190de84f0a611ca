"""docker-compose.yml and the Dockerfile agree with the package: services, start order,
commands and environment. (No container engine runs here; this reads the files.)"""

from __future__ import annotations

import shlex
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml
from celery import Celery

from celery_fence import cli as fence_cli
from celery_fence.contrib.celery.beat import FencedScheduler
from celery_fence.contrib.celery.settings import FenceSettings
from example_app import celery_app
from example_app.__main__ import cli as example_cli

ROOT = Path(__file__).resolve().parent.parent
APP_SERVICES = ("install", "worker-1", "worker-2", "beat-1", "beat-2")
WORKERS = ("worker-1", "worker-2")
BEATS = ("beat-1", "beat-2")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return dict(compose["services"])


def commands(service: dict[str, Any]) -> list[list[str]]:
    """The service's command as argument lists, one per ``&&``-joined step of ``sh -c``."""
    command = service["command"]
    if command[:2] == ["sh", "-c"]:
        return [shlex.split(step) for step in command[2].split("&&")]
    return [command]


def test_every_service_is_there(services: dict[str, Any]) -> None:
    assert set(services) == {"postgres", "redis", *APP_SERVICES}


def test_app_services_run_the_image_built_from_the_dockerfile(services: dict[str, Any]) -> None:
    images = {services[name]["image"] for name in APP_SERVICES}
    assert len(images) == 1
    assert all(services[name]["build"] == "." for name in APP_SERVICES)


def test_postgres_and_redis_report_their_health(services: dict[str, Any]) -> None:
    # Over TCP: a check on the Unix socket passes while the image's initialization runs a
    # server that accepts no TCP connection yet.
    assert services["postgres"]["healthcheck"]["test"][:4] == [
        "CMD",
        "pg_isready",
        "-h",
        "127.0.0.1",
    ]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_start_order_waits_on_conditions(services: dict[str, Any]) -> None:
    assert services["install"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in (*WORKERS, *BEATS):
        assert services[name]["depends_on"] == {
            "install": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        }
    for name, service in services.items():
        for dependency, rule in service.get("depends_on", {}).items():
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits on {dependency}"
    assert services["install"]["restart"] == "no"


def test_workers_run_the_example_app(services: dict[str, Any]) -> None:
    for name in WORKERS:
        (command,) = commands(services[name])
        assert command[:4] == ["celery", "-A", "example_app.celery_app", "worker"]
    assert isinstance(celery_app.app, Celery)
    assert "example_app.tasks.release" in celery_app.app.tasks
    assert _console_script("celery") == "celery.__main__:main"


def test_beats_run_the_fenced_scheduler(services: dict[str, Any]) -> None:
    for name in BEATS:
        # Named in the lease's holder, so that the docs can say how to tell which one leads.
        assert services[name]["hostname"] == name
        (command,) = commands(services[name])
        assert command[:4] == ["celery", "-A", "example_app.celery_app", "beat"]
        assert command[command.index("-S") + 1] == "fence"
    (scheduler,) = entry_points(group="celery.beat_schedulers", name="fence")
    assert scheduler.load() is FencedScheduler


def test_install_creates_both_schemas(services: dict[str, Any]) -> None:
    install, seed = commands(services["install"])
    assert install == ["celery-fence", "install"]
    assert _console_script("celery-fence") == "celery_fence.cli:main"
    assert "install" in fence_cli.main.commands
    assert seed == ["python", "-m", "example_app", "seed"]
    assert "seed" in example_cli.commands


def test_every_variable_set_is_one_the_app_reads(services: dict[str, Any]) -> None:
    for name in APP_SERVICES:
        environment = services[name]["environment"]
        for variable, value in environment.items():
            assert celery_app.config_from_env({variable: str(value)}) != (
                celery_app.config_from_env({})
            ), f"{name} sets {variable}, which example_app does not read"
        FenceSettings.from_conf(celery_app.config_from_env(environment))


def test_every_required_variable_is_set(services: dict[str, Any]) -> None:
    for name in APP_SERVICES:
        assert set(celery_app.REQUIRED_VARIABLES) <= set(services[name]["environment"]), name
    read_by_cli = {p.envvar for p in fence_cli.main.params if isinstance(p, click.Option)}
    assert "CELERY_FENCE_DATABASE_URL" in read_by_cli


def test_urls_name_the_services(services: dict[str, Any]) -> None:
    environment = services["install"]["environment"]
    database = urlsplit(environment["CELERY_FENCE_DATABASE_URL"])
    postgres = services["postgres"]["environment"]
    assert (database.hostname, database.username, database.password, database.path) == (
        "postgres",
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        f"/{postgres['POSTGRES_DB']}",
    )
    for variable in ("CELERY_FENCE_BROKER_URL", "CELERY_FENCE_RESULT_BACKEND"):
        assert urlsplit(environment[variable]).hostname == "redis"


def test_dockerfile_installs_the_package_and_copies_the_example() -> None:
    lines = [
        line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines() if line.strip()
    ]
    assert "FROM python:3.11-slim" in lines
    assert 'RUN pip install --no-cache-dir ".[celery]"' in lines
    copies = [shlex.split(line)[1:-1] for line in lines if line.startswith("COPY ")]
    assert ["example_app"] in copies
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is missing"


def _console_script(name: str) -> str:
    (script,) = entry_points(group="console_scripts", name=name)
    return script.value
