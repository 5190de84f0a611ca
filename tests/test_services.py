"""scripts/services.py with CELERY_FENCE_DATABASE_URL set: a server chosen on purpose is used as
it is, and one that does not answer, or lacks the database, is an error that says what to do,
never replaced by another."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy.engine import make_url

SERVICES = Path(__file__).resolve().parent.parent / "scripts" / "services.py"


def find_postgres(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SERVICES), "postgres", "--require"],
        env={**os.environ, "CELERY_FENCE_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def plain(url: str, **parts: str) -> str:
    """``url`` as libpq writes it (``postgresql://``), password and all, with ``parts``
    replaced."""
    return make_url(url).set(drivername="postgresql", **parts).render_as_string(hide_password=False)


def test_a_database_url_that_answers_is_used_as_it_is(database_url: str) -> None:
    found = find_postgres(plain(database_url))
    assert (found.returncode, found.stdout.strip()) == (0, plain(database_url))


def test_a_database_url_whose_database_is_missing_says_how_to_create_it(
    database_url: str,
) -> None:
    url = make_url(database_url)
    found = find_postgres(plain(database_url, database="cf_no_such_database"))
    assert found.returncode == 1
    assert found.stdout == ""
    assert (
        "CELERY_FENCE_DATABASE_URL names a database its server does not have "
        '(database "cf_no_such_database" does not exist): create it (createdb -h '
        f"{url.host} -U {url.username} cf_no_such_database), or unset the variable"
    ) in found.stderr


def test_a_database_url_that_does_not_answer_is_an_error_not_replaced() -> None:
    found = find_postgres("postgresql://postgres@127.0.0.1:1/test")
    assert found.returncode == 1
    assert found.stdout == ""
    assert "CELERY_FENCE_DATABASE_URL does not answer (" in found.stderr
    assert "start that server, or unset the variable" in found.stderr
