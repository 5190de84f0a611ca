"""pytest-celery stays installed without taking Celery's embedded fixtures away (see conftest)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import celery.contrib.pytest
import pytest
from celery import Celery
from celery.worker import WorkController

if TYPE_CHECKING:
    from conftest import Wait


def test_pytest_celery_plugin_is_loaded_and_its_docker_worker_is_shadowed_here(
    request: pytest.FixtureRequest,
) -> None:
    plugin = request.config.pluginmanager.get_plugin("celery")
    assert plugin is not None
    assert plugin.__name__ == "pytest_celery.plugin"
    definitions = request._fixturemanager.getfixturedefs("celery_worker", request.node)
    assert definitions is not None
    # Last one wins: pytest-celery's Docker worker (parametrized over its worker containers)
    # comes after -p celery.contrib.pytest, and this directory's conftest comes after both.
    assert [(d.func.__module__, d.baseid, d.params) for d in definitions] == [
        ("celery.contrib.pytest", "", None),
        ("pytest_celery.fixtures.worker", "", ("celery_setup_worker",)),
        ("celery.contrib.pytest", "tests/celery", None),
    ]
    assert definitions[-1].func is celery.contrib.pytest.celery_worker.__wrapped__


def test_celery_embedded_fixtures_run_a_fenced_task(
    fenced_ping: Any, celery_app: Celery, celery_worker: WorkController, wait: Wait
) -> None:
    assert isinstance(celery_worker, WorkController)
    assert fenced_ping.app is celery_app
    assert celery_app.conf.broker_url == "memory://"
    first = fenced_ping.delay("embedded")
    assert wait.outcome(first) == ["owner", 1]
    second = fenced_ping.delay("embedded")
    assert wait.outcome(second) == ["owner", 2]
