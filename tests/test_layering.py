"""The core (``celery_fence`` less ``contrib`` and the CLI) imports neither Celery, kombu nor a
database driver: the Celery integration sits around it, and SQLAlchemy is its only way to the
database."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_fence"
FORBIDDEN = {"celery", "kombu", "psycopg", "psycopg2"}
CORE = sorted(path for path in PACKAGE.glob("*.py") if path.name != "cli.py")


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every module ``path`` imports, wherever the import stands."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_core_is_what_this_test_checks() -> None:
    names = {path.name for path in CORE}
    assert {"__init__.py", "store.py", "models.py", "exceptions.py", "validation.py"} <= names
    assert "sqlalchemy" in imported_roots(PACKAGE / "store.py")


@pytest.mark.parametrize("path", CORE, ids=[path.name for path in CORE])
def test_core_modules_import_neither_celery_nor_a_driver(path: Path) -> None:
    assert imported_roots(path) & FORBIDDEN == set()


def test_importing_the_package_loads_neither_celery_nor_a_driver() -> None:
    probe = (
        "import json, sys, celery_fence, celery_fence.store;"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert "sqlalchemy" in loaded
    assert loaded & FORBIDDEN == set()
