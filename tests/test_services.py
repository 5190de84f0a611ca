"""scripts/services.py with CELERY_FENCE_DATABASE_URL set: a server chosen on purpose is used as
it is, and one that does not answer, or lacks the database, is an error that says what to do,
never replaced by another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

SERVICES = Path(__file__).resolve().parent.parent / "scripts" / "services.py"


def services(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SERVICES), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def find_postgres(url: str) -> subprocess.CompletedProcess[str]:
    return services("postgres", "--require", CELERY_FENCE_DATABASE_URL=url)


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


def test_a_database_urls_query_parameters_name_its_server_as_libpq_takes_them(
    database_url: str,
) -> None:
    url = make_url(database_url)
    named = (
        f"postgresql://nobody@127.0.0.1:1/elsewhere?host={url.host}&port={url.port or 5432}"
        f"&user={url.username}&dbname={url.database}"
    )
    found = find_postgres(named)
    assert (found.returncode, found.stdout.strip()) == (0, named)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgresql://postgres@127.0.0.1:abc/test", "Port could not be cast"),
        ("postgresql://postgres@127.0.0.1:99999/test", "Port out of range"),
        ("postgresql://postgres@[::1/test", "Invalid IPv6 URL"),
        ("host=127.0.0.1 user=postgres dbname=test", "scheme ''"),
    ],
)
def test_a_database_url_that_is_no_postgresql_url_says_so_in_one_line(url: str, why: str) -> None:
    found = find_postgres(url)
    assert found.returncode == 1
    assert found.stdout == ""
    assert found.stderr.startswith(
        "error: PostgreSQL is not available: CELERY_FENCE_DATABASE_URL is not a "
        f"postgresql://user@host:port/database URL ({why}"
    )
    assert "Traceback" not in found.stderr


def test_stopping_a_throwaway_cluster_whose_postmaster_died_cleans_up(tmp_path: Path) -> None:
    """Its postmaster.pid names a process that is gone (and could be anyone's by now): no
    signal is sent, and the cluster's directory and record go all the same."""
    state_dir = tmp_path / f"celery-fence-services-{os.getuid()}"
    state_dir.mkdir(mode=0o700)
    base = tmp_path / "celery-fence-pg-dead"
    (base / "data").mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (base / "data" / "postmaster.pid").write_text(f"{gone.pid}\n{base / 'data'}\n")
    state = {"base": str(base), "bindir": str(tmp_path / "no-bin"), "user": None, "port": 1}
    (state_dir / "postgres-throwaway.json").write_text(json.dumps(state))

    stopped = services("stop-throwaway", TMPDIR=str(tmp_path))

    assert stopped.returncode == 0
    assert f"stopped the throwaway PostgreSQL cluster in {base}" in stopped.stderr
    assert "SIGTERM" not in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert not base.exists()
    assert not (state_dir / "postgres-throwaway.json").exists()
