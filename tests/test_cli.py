"""The ``celery-fence`` command line against a real database: every command, its JSON, its exit
codes and its one-line errors, and the canary race with real processes."""

from __future__ import annotations

import dataclasses
import doctest
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import make_url

from celery_fence import LeaseStore, Owner, _sql
from celery_fence.cli import ExitCode, RaceAnswer, main, race_problems
from celery_fence.models import Lease
from celery_fence.store import proof

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "reference" / "cli.md"
UNREACHABLE = "postgresql://postgres:s3cret@127.0.0.1:1/test"
OWNER_KEYS = {field.name for field in dataclasses.fields(Owner)}
LEASE_KEYS = {field.name for field in dataclasses.fields(Lease)} - {
    "deadline",
    "sharer",
    "joined_at",
}
TOKEN = str(uuid.UUID(int=1))
IDENTITY = {
    "name": "job",
    "environment": "default",
    "holder": "a",
    "epoch": 1,
    "token": TOKEN,
    "ttl": 5,
}


def cli(url: str | None, *args: str, stdin: str | None = None, **env: str) -> Result:
    """Run ``celery-fence [--database-url URL] ARGS`` in this process, with a clean environment."""
    environ: dict[str, str | None] = {
        "CELERY_FENCE_DATABASE_URL": None,
        "CELERY_FENCE_ENVIRONMENT": None,
        **env,
    }
    prefix = [] if url is None else ["--database-url", url]
    return CliRunner().invoke(main, [*prefix, *args], input=stdin, env=environ)


def answer(result: Result) -> Any:
    return json.loads(result.stdout)


def assert_error(result: Result, code: ExitCode, *fragments: str) -> None:
    """A user's mistake: one ``Error:`` line on stderr, the exit code, no traceback."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def acquire(
    url: str, name: str, holder: str, *extra: str, ttl: str = "30", environment: str = "default"
) -> Result:
    """``celery-fence --environment ENV acquire NAME --holder HOLDER --ttl TTL EXTRA...``"""
    return cli(
        url, "--environment", environment, "acquire", name, "--holder", holder, "--ttl", ttl, *extra
    )


def when(value: str) -> datetime:
    return datetime.fromisoformat(value)


def run_with_stdout(url: str, stdout: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery-fence ARGS`` in a process of its own whose stdout is ``full`` (``/dev/full``),
    ``closed``, or ``gone`` (a pipe whose reader has gone)."""
    command = [sys.executable, "-m", "celery_fence.cli", *args]
    env = {**os.environ, "CELERY_FENCE_DATABASE_URL": url}
    env.pop("CELERY_FENCE_ENVIRONMENT", None)
    if stdout == "closed":
        command = ["bash", "-c", 'exec "$@" >&-', "bash", *command]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        with open("/dev/full", "w", encoding="utf-8") as full:
            return subprocess.run(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout={"full": full.fileno(), "closed": None, "gone": write_end}[stdout],
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                check=False,
            )
    finally:
        os.close(write_end)


# -- install ---------------------------------------------------------------------------------


def test_install_print_needs_no_database() -> None:
    for url in (None, UNREACHABLE):
        result = cli(url, "install", "--print")
        assert result.exit_code == 0, result.stderr
        assert result.stdout == LeaseStore.install_script()
        assert result.stderr == ""


def test_install_creates_the_schema_once_and_prints_its_version(empty_database_url: str) -> None:
    assert_error(cli(empty_database_url, "status"), ExitCode.ERROR, "run `celery-fence install`")
    expected = f"celery-fence schema version {_sql.latest_version()}\n"
    for _ in range(2):
        result = cli(empty_database_url, "install")
        assert result.exit_code == 0, result.stderr
        assert result.stdout == expected
    assert cli(empty_database_url, "status").stdout == "no leases\n"


def test_schema_not_installed_is_one_line(empty_database_url: str) -> None:
    result = acquire(empty_database_url, "job", "a")
    assert_error(result, ExitCode.ERROR, "not installed", "run `celery-fence install`")
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["acquire", "canary"])
def test_a_schema_older_than_the_package_grants_no_lease(
    database_url: str, store: LeaseStore, command: str
) -> None:
    """An older schema may grant a lease it then cannot renew or release: acquire (and the
    canary, which acquires) refuse it first, naming both versions."""
    latest = _sql.latest_version()
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("DELETE FROM celery_fence.migrations WHERE version = :v"), {"v": latest}
        )
    args = ["job", "--holder", "a", "--ttl", "30"] if command == "acquire" else ["--name", "job"]
    result = cli(database_url, command, *args)
    assert_error(
        result,
        ExitCode.ERROR,
        f"celery-fence schema is at version {latest - 1}, this package needs {latest}; run "
        f"`celery-fence install` [database {database_url}]",
    )
    assert result.stderr.count("[database ") == 1
    assert result.stdout == ""
    with store.engine.connect() as conn:
        leases = conn.exec_driver_sql("SELECT count(*) FROM celery_fence.leases").scalar_one()
    assert leases == 0


def test_version() -> None:
    result = cli(None, "--version")
    assert result.exit_code == 0
    assert version("celery-fence") in result.stdout


# -- bad configuration ------------------------------------------------------------------------


def test_commands_other_than_install_print_need_a_database_url() -> None:
    assert_error(cli(None, "status"), ExitCode.USAGE, "--database-url", "CELERY_FENCE_DATABASE_URL")


def test_database_url_from_the_environment(database_url: str) -> None:
    result = cli(None, "status", CELERY_FENCE_DATABASE_URL=database_url)
    assert (result.exit_code, result.stdout) == (0, "no leases\n")


def test_unreachable_database_names_host_and_port_but_not_the_password() -> None:
    for args in (("status",), ("acquire", "job", "--holder", "a", "--ttl", "5"), ("install",)):
        result = cli(UNREACHABLE, *args)
        assert_error(result, ExitCode.ERROR, "127.0.0.1", "port 1", "postgres:***@127.0.0.1:1")
        assert "s3cret" not in result.stderr


def test_passwords_given_as_url_parameters_are_hidden_too() -> None:
    url = "postgresql://postgres@127.0.0.1:1/none?sslpassword=k3y&connect_timeout=2&password=s3cret"
    result = cli(url, "status")
    assert_error(
        result,
        ExitCode.ERROR,
        "[database postgresql://postgres@127.0.0.1:1/none?connect_timeout=2&password=***"
        "&sslpassword=***]",
    )
    assert result.stderr.count("[database ") == 1
    assert "s3cret" not in result.stderr
    assert "k3y" not in result.stderr


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///fence.db", "needs PostgreSQL"),
        ("postgresql://postgres:s3cret@host:notaport/db", "not a valid database URL"),
        ("not a url s3cret", "not a valid database URL"),
        ("postgresql+psycopg_async://postgres:s3cret@127.0.0.1/db", "without asyncio"),
    ],
)
def test_invalid_database_url(url: str, message: str) -> None:
    result = cli(url, "status")
    assert_error(result, ExitCode.USAGE, message)
    assert "s3cret" not in result.stderr


def test_libpqs_postgres_scheme_is_postgresql(database_url: str) -> None:
    libpq_style = make_url(database_url).set(drivername="postgres")
    result = cli(libpq_style.render_as_string(hide_password=False), "status")
    assert result.exit_code == 0, result.output


# -- acquire ---------------------------------------------------------------------------------


def test_acquire_prints_the_winners_lease_with_its_token(
    database_url: str, store: LeaseStore
) -> None:
    result = acquire(
        database_url,
        "release:prod",
        "deploy@a",
        "--max-hold",
        "60",
        "--purpose",
        "release 42",
        environment="prod",
    )
    assert result.exit_code == ExitCode.OK, result.stderr
    assert result.stderr == ""
    got = answer(result)
    assert set(got) == {"outcome", "acquired", "lease", "owner"}
    assert (got["outcome"], got["acquired"]) == ("acquired", True)
    lease = got["lease"]
    assert set(lease) == LEASE_KEYS
    assert uuid.UUID(lease["token"])
    assert (lease["name"], lease["environment"], lease["holder"]) == (
        "release:prod",
        "prod",
        "deploy@a",
    )
    assert (lease["epoch"], lease["purpose"], lease["ttl"]) == (1, "release 42", 30.0)
    assert when(lease["expires_at"]) - when(lease["acquired_at"]) == timedelta(seconds=30)
    assert when(lease["hold_until"]) - when(lease["acquired_at"]) == timedelta(seconds=60)
    assert set(got["owner"]) == OWNER_KEYS
    owner = store.owner("release:prod")
    assert owner is not None
    assert (owner.holder, owner.epoch, owner.environment) == ("deploy@a", 1, "prod")
    assert owner.expires_at == when(lease["expires_at"])


def test_environment_from_the_environment_variable(database_url: str, store: LeaseStore) -> None:
    result = cli(
        database_url,
        "acquire",
        "job",
        "--holder",
        "a",
        "--ttl",
        "5",
        CELERY_FENCE_ENVIRONMENT="staging",
    )
    assert answer(result)["lease"]["environment"] == "staging"
    owner = store.owner("job")
    assert owner is not None
    assert owner.environment == "staging"


def test_the_loser_learns_the_owner_and_never_a_token(database_url: str) -> None:
    winner = answer(acquire(database_url, "job", "a"))
    result = acquire(database_url, "job", "b")
    assert result.exit_code == ExitCode.HELD
    assert result.stderr == ""
    lost = answer(result)
    assert (lost["outcome"], lost["acquired"], lost["lease"]) == ("held", False, None)
    assert set(lost["owner"]) == OWNER_KEYS
    assert (lost["owner"]["holder"], lost["owner"]["epoch"]) == ("a", 1)
    assert "token" not in result.stdout
    assert winner["lease"]["token"] not in result.stdout


def test_acquire_on_a_paused_lease_exits_4(database_url: str) -> None:
    cli(database_url, "pause", "job", "--new", "--reason", "investigating", "--by", "ops")
    result = acquire(database_url, "job", "a")
    assert result.exit_code == ExitCode.PAUSED
    got = answer(result)
    assert (got["outcome"], got["acquired"], got["lease"]) == ("paused", False, None)
    assert (got["owner"]["paused_by"], got["owner"]["paused_reason"]) == ("ops", "investigating")


@pytest.mark.parametrize("ttl", ["0", "-1", "nan", "inf", "100000"])
def test_a_bad_ttl_is_one_line_and_writes_nothing(database_url: str, ttl: str) -> None:
    assert_error(acquire(database_url, "job", "a", ttl=ttl), ExitCode.USAGE, "ttl")
    assert cli(database_url, "status").stdout == "no leases\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("acquire", " job", "--holder", "a", "--ttl", "5"), "lease name"),
        (("acquire", "job", "--holder", "", "--ttl", "5"), "holder"),
        (("acquire", "job", "--holder", "a", "--ttl", "5", "--max-hold", "1"), "max_hold"),
        (("--environment", "", "acquire", "job", "--holder", "a", "--ttl", "5"), "environment"),
        (("history", "job", "--limit", "0"), "limit"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    database_url: str, args: tuple[str, ...], message: str
) -> None:
    assert_error(cli(database_url, *args), ExitCode.USAGE, message)
    assert cli(database_url, "status").stdout == "no leases\n"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--holder", "", "holder must not be empty"),
        ("--ttl", "0", "ttl must be greater than 0"),
        ("--max-hold", "1", "max_hold (1s) must be at least ttl"),
        ("--purpose", " release", "purpose must not start or end with whitespace"),
        ("--wait", "-1", "wait must be 0 or more seconds"),
    ],
)
def test_an_acquisition_at_a_start_barrier_is_checked_before_it_lines_up(
    tmp_path: Path, option: str, value: str, message: str
) -> None:
    flags = {"--holder": "a", "--ttl": "5", option: value}
    args = [word for flag in flags.items() for word in flag]
    # The database is unreachable: the input is refused before anything connects.
    result = cli(UNREACHABLE, "acquire", "job", *args, "--start-barrier", str(tmp_path))
    assert_error(result, ExitCode.USAGE, message)
    assert list(tmp_path.iterdir()) == [], "nothing lined up"


def test_a_start_barrier_it_cannot_write_in_is_one_line(
    database_url: str, store: LeaseStore, tmp_path: Path
) -> None:
    # The ready file cannot be made: its name leads into a directory that does not exist.
    ready = tmp_path / f"ready.{os.getpid()}"
    ready.symlink_to(tmp_path / "gone" / "ready")
    result = acquire(database_url, "job", "a", "--start-barrier", str(tmp_path))
    assert_error(result, ExitCode.USAGE, f"--start-barrier: cannot create {ready}", "No such file")
    assert store.owner("job") is None


@pytest.mark.parametrize("stdout", ["full", "closed", "gone"])
def test_an_acquisition_whose_answer_cannot_be_written_gives_the_lease_back(
    database_url: str, store: LeaseStore, stdout: str
) -> None:
    result = run_with_stdout(database_url, stdout, "acquire", "job", "--holder", "a", "--ttl", "30")
    assert result.returncode == ExitCode.ERROR, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: cannot write to stdout: "), line
    assert line.endswith("lease job epoch 1 was won and given back, since no one has its token")
    owner = store.owner("job")
    assert owner is not None
    assert (owner.holder, owner.epoch, owner.state) == ("a", 1, "released")


def test_an_acquisition_whose_answer_cannot_be_written_in_its_ttl_is_left_to_expire(
    database_url: str, store: LeaseStore
) -> None:
    """Its TTL has run out by the time the answer fails: a release would be a stale one,
    recorded as such; the lease is left to expire instead."""
    args = ("acquire", "job", "--holder", "a", "--ttl", "0.001")
    result = run_with_stdout(database_url, "full", *args)
    assert result.returncode == ExitCode.ERROR, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: cannot write to stdout: "), line
    assert re.search(r"; lease job epoch 1 was won, and runs out by \S+ unused$", line), line
    owner = store.owner("job")
    assert owner is not None
    assert (owner.holder, owner.epoch, owner.state) == ("a", 1, "expired")
    assert store.stale_runs() == []


def test_a_losers_answer_that_cannot_be_written_is_one_line(
    database_url: str, store: LeaseStore
) -> None:
    acquire(database_url, "job", "a")
    result = run_with_stdout(database_url, "full", "acquire", "job", "--holder", "b", "--ttl", "30")
    assert result.returncode == ExitCode.ERROR, result.stderr
    assert result.stderr == "Error: cannot write to stdout: No space left on device\n"
    owner = store.owner("job")
    assert owner is not None
    assert (owner.holder, owner.state) == ("a", "held")


def test_verbose_logs_on_stderr(database_url: str) -> None:
    result = cli(database_url, "-v", "acquire", "job", "--holder", "a", "--ttl", "5")
    assert result.exit_code == ExitCode.OK
    assert "INFO celery_fence: lease job acquired by a at epoch 1" in result.stderr


@pytest.mark.parametrize("verbose", [False, True])
def test_warnings_of_the_libraries_below_show_only_when_verbose(
    database_url: str, verbose: bool
) -> None:
    """psycopg warns of a session time zone it does not know (it prints times in UTC then). A
    process of its own, since pytest's log capture would take the warning in this one."""
    result = subprocess.run(
        [sys.executable, "-m", "celery_fence.cli", *(["-v"] if verbose else []), "status"],
        env={**os.environ, "CELERY_FENCE_DATABASE_URL": database_url, "PGTZ": "UTC+5"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, "no leases\n"), result.stderr
    warning = "WARNING psycopg: unknown PostgreSQL timezone: 'UTC+5'; will use UTC\n"
    assert result.stderr == (warning if verbose else "")


# -- renew and release ------------------------------------------------------------------------


def holder_flags(lease: dict[str, Any]) -> list[str]:
    """NAME --epoch --token --holder for renew and release, from an acquire answer's lease."""
    name, epoch, token, holder = lease["name"], str(lease["epoch"]), lease["token"], lease["holder"]
    return [name, "--epoch", epoch, "--token", token, "--holder", holder]


def test_renew_with_flags_keeps_epoch_and_token(database_url: str, store: LeaseStore) -> None:
    lease = answer(acquire(database_url, "job", "a", ttl="5"))["lease"]
    result = cli(database_url, "renew", *holder_flags(lease), "--ttl", "60")
    assert result.exit_code == ExitCode.OK, result.stderr
    renewed = answer(result)
    assert set(renewed) == {"outcome", "lease"}
    assert renewed["outcome"] == "renewed"
    assert set(renewed["lease"]) == LEASE_KEYS
    for key in ("name", "holder", "epoch", "token", "acquired_at"):
        assert renewed["lease"][key] == lease[key]
    assert renewed["lease"]["ttl"] == 60.0
    assert when(renewed["lease"]["expires_at"]) > when(lease["expires_at"])
    owner = store.owner("job")
    assert owner is not None
    assert owner.expires_at == when(renewed["lease"]["expires_at"])


def test_renew_and_release_read_the_lease_from_json(database_url: str, tmp_path: Path) -> None:
    acquired = acquire(database_url, "job", "a", "--purpose", "nightly")
    saved = tmp_path / "lease.json"
    saved.write_text(acquired.stdout)
    renewed = cli(database_url, "renew", "--lease-json", str(saved))
    assert renewed.exit_code == ExitCode.OK, renewed.stderr
    assert answer(renewed)["lease"]["ttl"] == 30.0
    assert answer(renewed)["lease"]["purpose"] == "nightly"
    renamed = cli(
        database_url, "renew", "job", "--lease-json", "-", "--ttl", "10", stdin=renewed.stdout
    )
    assert answer(renamed)["lease"]["ttl"] == 10.0
    released = cli(database_url, "release", "--lease-json", "-", stdin=renamed.stdout)
    assert released.exit_code == ExitCode.OK, released.stderr
    assert answer(released) == {"outcome": "released", "name": "job", "epoch": 1, "holder": "a"}
    again = cli(database_url, "release", "--lease-json", str(saved))
    assert again.exit_code == ExitCode.OK, "releasing twice is harmless"
    successor = answer(acquire(database_url, "job", "b"))
    assert (successor["acquired"], successor["lease"]["epoch"]) == (True, 2)


def test_a_release_names_the_leases_holder_not_the_one_it_was_given(database_url: str) -> None:
    """A release is of the token: one that names another holder releases the lease all the
    same, and its answer names the lease's own holder."""
    lease = answer(acquire(database_url, "job", "a"))["lease"]
    result = cli(database_url, "release", *holder_flags({**lease, "holder": "someone-else"}))
    assert result.exit_code == ExitCode.OK, result.stderr
    assert answer(result) == {"outcome": "released", "name": "job", "epoch": 1, "holder": "a"}


def test_a_sharer_releasing_a_shared_lease_only_leaves_it(
    database_url: str, store: LeaseStore
) -> None:
    lease = store.acquire("job", holder="a", ttl=30).lease
    assert lease is not None
    # A continuation shares the lease: two sharers now hold it.
    joined = store.rejoin(
        "job",
        epoch=lease.epoch,
        holder="a",
        mode="resume",
        proof=proof(lease, "resume"),
        ttl=30,
        action="start child",
    )
    assert joined.outcome == "joined"
    flags = ["job", "--epoch", str(lease.epoch), "--token", str(lease.token), "--holder", "a"]
    left = cli(database_url, "release", *flags)
    assert left.exit_code == ExitCode.OK, left.stderr
    assert answer(left) == {"outcome": "left", "name": "job", "epoch": 1, "holder": "a"}
    [owner] = answer(cli(database_url, "status", "job", "--json"))
    assert owner["state"] == "held"
    assert answer(cli(database_url, "release", *flags))["outcome"] == "released"
    [owner] = answer(cli(database_url, "status", "job", "--json"))
    assert owner["state"] == "released"


def test_renewing_a_superseded_lease_exits_5_with_the_owner(database_url: str) -> None:
    lease = answer(acquire(database_url, "job", "a"))["lease"]
    assert cli(database_url, "release", *holder_flags(lease)).exit_code == ExitCode.OK
    acquire(database_url, "job", "b")
    result = cli(database_url, "renew", *holder_flags(lease), "--ttl", "30")
    assert_error(result, ExitCode.LOST, "superseded", "holder b")
    lost = answer(result)
    assert set(lost) == {"outcome", "reason", "name", "epoch", "owner"}
    assert (lost["outcome"], lost["reason"], lost["name"], lost["epoch"]) == (
        "lost",
        "superseded",
        "job",
        1,
    )
    assert (lost["owner"]["holder"], lost["owner"]["epoch"]) == ("b", 2)
    assert "token" not in result.stdout


def test_releasing_with_a_wrong_token_exits_5_and_keeps_the_lease(database_url: str) -> None:
    lease = answer(acquire(database_url, "job", "a"))["lease"]
    forged = {**lease, "token": str(uuid.uuid4())}
    result = cli(database_url, "release", *holder_flags(forged))
    assert_error(result, ExitCode.LOST, "forged")
    assert answer(result)["reason"] == "forged"
    [owner] = answer(cli(database_url, "status", "job", "--json"))
    assert (owner["holder"], owner["epoch"], owner["state"]) == ("a", 1, "held")


@pytest.mark.parametrize(
    ("command", "done"),
    [("renew", "renewed"), ("release", "released"), ("pause", "paused"), ("resume", "resumed")],
)
def test_a_call_kept_waiting_by_a_fenced_writer_is_one_line_and_changes_nothing(
    database_url: str, store: LeaseStore, command: str, done: str
) -> None:
    lease = answer(acquire(database_url, "job", "a"))["lease"]
    args = {
        "renew": [*holder_flags(lease), "--ttl", "60"],
        "release": holder_flags(lease),
        "pause": ["job", "--reason", "audit"],
        "resume": ["job"],
    }[command]
    # A fenced writer's lock on the lease row, held until its transaction ends (or, should a
    # call wait past its lock timeout, until the server ends the idle session).
    with store.engine.connect() as writer:
        writer.exec_driver_sql("SET idle_in_transaction_session_timeout = '10s'")
        writer.exec_driver_sql("SELECT 1 FROM celery_fence.leases WHERE name = 'job' FOR SHARE")
        started = time.monotonic()
        result = cli(database_url, "--lock-timeout", "0.5", command, *args)
        waited = time.monotonic() - started
    assert_error(result, ExitCode.ERROR, f"not {done}", "past lock_timeout (0.5s)", "unchanged")
    assert 0.5 <= waited < 5
    assert result.stdout == ""
    [owner] = answer(cli(database_url, "status", "job", "--json"))
    assert (owner["holder"], owner["epoch"], owner["state"]) == ("a", 1, "held")
    assert owner["expires_at"] == lease["expires_at"]
    assert answer(cli(database_url, command, *args))["outcome"] == done


@pytest.mark.parametrize("command", [("status",), ("history", "job"), ("stale-runs",)])
def test_a_read_kept_waiting_by_a_table_lock_is_one_line_after_the_lock_timeout(
    database_url: str, store: LeaseStore, command: tuple[str, ...]
) -> None:
    """Maintenance (VACUUM FULL, a migration) holds the tables: a read gives up after the lock
    timeout instead of waiting for it."""
    acquire(database_url, "job", "a")
    with store.engine.begin() as maintenance:
        maintenance.exec_driver_sql(
            "LOCK TABLE celery_fence.leases, celery_fence.lease_history, celery_fence.stale_runs "
            "IN ACCESS EXCLUSIVE MODE"
        )
        started = time.monotonic()
        result = cli(database_url, "--lock-timeout", "0.5", *command)
        waited = time.monotonic() - started
    assert_error(result, ExitCode.ERROR, "lock timeout")
    assert 0.5 <= waited < 5
    assert cli(database_url, *command).exit_code == ExitCode.OK


def test_a_lock_timeout_beyond_a_minute_is_bad_input(database_url: str) -> None:
    result = cli(database_url, "--lock-timeout", "61", "pause", "job", "--reason", "audit")
    assert_error(result, ExitCode.USAGE, "--lock-timeout must be at most 60 seconds, got 61")
    assert cli(database_url, "status").stdout == "no leases\n"


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (
            ("renew", "job", "--epoch", "1", "--token", TOKEN, "--holder", "a"),
            None,
            "missing --ttl",
        ),
        (("release", "job", "--epoch", "1", "--holder", "a"), None, "missing --token"),
        (("release", "--epoch", "1", "--holder", "a", "--token", "x"), None, "missing NAME"),
        (
            ("release", "job", "--epoch", "1", "--holder", "a", "--token", "nope"),
            None,
            "token must be a UUID",
        ),
        (("release", "--lease-json", "-", "--epoch", "1"), "{}", "cannot be combined"),
        (("release", "--lease-json", "-"), '{"outcome": "held", "lease": null}', "holds no lease"),
        (("release", "--lease-json", "-"), '{"lease": {"name": "job"}}', "lacks environment"),
        (("release", "--lease-json", "-"), "{not json", "not JSON"),
        (
            ("release", "--lease-json", "-"),
            '{"lease": ' + "[" * 1000 + "]" * 1000 + "}",
            "--lease-json is nested too deeply to be a lease",
        ),
        (("renew", "--lease-json", "-"), json.dumps({"lease": {**IDENTITY, "ttl": "x"}}), "ttl"),
        (
            ("renew", "--lease-json", "-"),
            json.dumps({"lease": {**IDENTITY, "epoch": "1"}}),
            "epoch",
        ),
        (
            ("renew", "--lease-json", "-"),
            json.dumps({"lease": {**IDENTITY, "epoch": 2**63}}),
            "epoch must be an integer from 1 to 9223372036854775807",
        ),
        *(
            (
                (verb, "--lease-json", "-"),
                json.dumps({"lease": {**IDENTITY, "ttl": 10**400}}),
                "ttl",
            )
            for verb in ("renew", "release")
        ),
        (
            ("renew", "--lease-json", "-"),
            json.dumps({"lease": {**IDENTITY, "holder": 7}}),
            "holder",
        ),
        (("release", "other", "--lease-json", "-"), None, "is not the lease"),
    ],
)
def test_holder_identity_errors_are_caught_before_any_sql(
    database_url: str, args: tuple[str, ...], stdin: str | None, message: str
) -> None:
    if stdin is None and "--lease-json" in args:
        stdin = acquire(database_url, "job", "a").stdout
    # The database is unreachable: the input is refused before anything connects.
    assert_error(cli(UNREACHABLE, *args, stdin=stdin), ExitCode.USAGE, message)


@pytest.mark.parametrize("verb", ["renew", "release"])
def test_a_lease_json_file_that_is_not_text_is_bad_input(verb: str, tmp_path: Path) -> None:
    saved = tmp_path / "lease.json"
    saved.write_bytes(b"\xff\xfe{")
    result = cli(UNREACHABLE, verb, "--lease-json", str(saved))
    assert_error(result, ExitCode.USAGE, "--lease-json is not UTF-8 text")


@pytest.mark.parametrize(
    "command", [("renew", "--ttl", "5"), ("release",)], ids=["renew", "release"]
)
@pytest.mark.parametrize("epoch", ["0", "9223372036854775808", "99999999999999999999"])
def test_an_epoch_flag_beyond_bigint_is_bad_input_before_any_sql(
    command: tuple[str, ...], epoch: str
) -> None:
    verb, *options = command
    flags = ["job", "--epoch", epoch, "--token", TOKEN, "--holder", "a"]
    # The database is unreachable: click refuses the option before anything connects.
    result = cli(UNREACHABLE, verb, *flags, *options)
    assert result.exit_code == ExitCode.USAGE, result.stderr
    assert "Error: Invalid value for '--epoch'" in result.stderr
    assert "1<=x<=9223372036854775807" in result.stderr


# -- pause and resume -------------------------------------------------------------------------


def test_pause_and_resume(database_url: str) -> None:
    acquire(database_url, "job", "a")
    paused = cli(database_url, "pause", "job", "--reason", "investigating", "--by", "ops@a")
    assert paused.exit_code == ExitCode.OK, paused.stderr
    assert answer(paused)["outcome"] == "paused"
    owner = answer(paused)["owner"]
    assert set(owner) == OWNER_KEYS
    assert (owner["paused"], owner["paused_reason"], owner["paused_by"], owner["state"]) == (
        True,
        "investigating",
        "ops@a",
        "paused",
    )
    assert "by ops@a: investigating" in cli(database_url, "status").stdout
    assert acquire(database_url, "job", "b").exit_code == ExitCode.PAUSED
    resumed = cli(database_url, "resume", "job")
    assert resumed.exit_code == ExitCode.OK, resumed.stderr
    assert answer(resumed)["outcome"] == "resumed"
    assert (answer(resumed)["owner"]["paused"], answer(resumed)["owner"]["paused_by"]) == (
        False,
        None,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pause", "job", "--reason", ""), "reason must not be empty"),
        (("pause", "job", "--reason", "audit "), "reason must not start or end with"),
        (("pause", "job", "--reason", "audit", "--by", ""), "by (who pauses) must not be empty"),
        (("pause", "", "--reason", "audit"), "lease name must not be empty"),
        (("--environment", " prod", "pause", "job", "--reason", "audit"), "environment must not"),
        (("status", "job", "--environment", ""), "environment must not be empty"),
    ],
)
def test_pause_and_status_input_is_refused_before_any_sql(
    args: tuple[str, ...], message: str
) -> None:
    # The database is unreachable: the input is refused before anything connects.
    assert_error(cli(UNREACHABLE, *args), ExitCode.USAGE, message)


def test_pause_defaults_by_to_user_at_host(database_url: str) -> None:
    owner = answer(cli(database_url, "pause", "new-lease", "--new", "--reason", "not yet"))["owner"]
    assert re.fullmatch(r".+@.+", owner["paused_by"]), owner["paused_by"]
    assert (owner["holder"], owner["epoch"], owner["state"]) == ("", 0, "paused")


def test_pause_of_a_name_no_lease_has_is_refused_unless_new(database_url: str) -> None:
    """A mistyped name pauses nothing, and says so, instead of creating a paused lease nobody
    uses while the real one runs on."""
    acquire(database_url, "release:prod", "deploy")
    result = cli(database_url, "pause", "release:prdo", "--reason", "incident")
    assert_error(
        result,
        ExitCode.ERROR,
        "no lease named release:prdo: nothing paused",
        "pass --new",
    )
    assert result.stdout == ""
    names = [owner["name"] for owner in answer(cli(database_url, "status", "--json"))]
    assert names == ["release:prod"]


def test_resume_of_an_unknown_lease_is_one_line(database_url: str) -> None:
    assert_error(cli(database_url, "resume", "ghost"), ExitCode.ERROR, "no lease named ghost")


# -- reading ----------------------------------------------------------------------------------


def test_status_table_json_and_filters(database_url: str) -> None:
    acquire(database_url, "a-lease", "alpha", "--purpose", "x")
    acquire(database_url, "b-lease", "beta", ttl="5", environment="test")
    table = cli(database_url, "status").stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "ENVIRONMENT",
        "HOLDER",
        "EPOCH",
        "STATE",
        "EXPIRES_AT",
        "PAUSED",
    ]
    assert [row.split()[:5] for row in table[1:]] == [
        ["a-lease", "default", "alpha", "1", "held"],
        ["b-lease", "test", "beta", "1", "held"],
    ]
    everything = answer(cli(database_url, "status", "--json"))
    assert [owner["name"] for owner in everything] == ["a-lease", "b-lease"]
    assert all(set(owner) == OWNER_KEYS for owner in everything)
    only_test = answer(cli(database_url, "status", "--environment", "test", "--json"))
    assert [owner["name"] for owner in only_test] == ["b-lease"]
    one = cli(database_url, "status", "b-lease")
    assert [row.split()[0] for row in one.stdout.splitlines()] == ["NAME", "b-lease"]
    assert_error(
        cli(database_url, "status", "b-lease", "--environment", "default"),
        ExitCode.ERROR,
        "no lease named b-lease in environment default",
    )
    assert_error(cli(database_url, "status", "ghost"), ExitCode.ERROR, "no lease named ghost")


def test_a_table_escapes_what_is_not_printable(database_url: str, store: LeaseStore) -> None:
    """The store refuses such text, but the SQL functions take any: a table shows it escaped, so
    that it cannot break a row or drive the terminal."""
    acquire(database_url, "job", "a")
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("SELECT celery_fence.pause('job', :reason, :by)"),
            {"reason": "line\nbreak\x1b[2J", "by": "ops\tx"},
        )
    result = cli(database_url, "status")
    assert result.exit_code == ExitCode.OK, result.stderr
    _, row = result.stdout.splitlines()
    assert row.endswith("by ops\\tx: line\\nbreak\\x1b[2J")
    assert row.isprintable()
    paused = answer(cli(database_url, "status", "--json"))[0]
    assert paused["paused_reason"] == "line\nbreak\x1b[2J", "JSON keeps the text as it is"


def test_a_table_escapes_what_the_terminals_encoding_cannot_hold(database_url: str) -> None:
    assert acquire(database_url, "job-\U0001f600", "a").exit_code == ExitCode.OK
    command = [sys.executable, "-m", "celery_fence.cli", "--database-url", database_url, "status"]
    result = subprocess.run(
        command,
        env={**os.environ, "PYTHONIOENCODING": "latin-1"},
        capture_output=True,
        text=True,
        encoding="latin-1",
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")
    _, row = result.stdout.splitlines()
    assert row.startswith("job-\\U0001f600 ")


@pytest.mark.parametrize(
    "args",
    [("install", "--print"), ("status",), ("status", "--json"), ("history", "job")],
    ids=" ".join,
)
def test_output_stdout_cannot_take_is_one_line(database_url: str, args: tuple[str, ...]) -> None:
    acquire(database_url, "job", "a")
    for stdout, reason in (("full", "No space left on device"), ("closed", "stdout is closed")):
        result = run_with_stdout(database_url, stdout, *args)
        assert (result.returncode, result.stderr) == (
            ExitCode.ERROR,
            f"Error: cannot write to stdout: {reason}\n",
        )


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("status", "--help")], ids=" ".join)
def test_help_stdout_cannot_take_is_one_line(database_url: str, args: tuple[str, ...]) -> None:
    for stdout, reason in (("full", "No space left on device"), ("closed", "stdout is closed")):
        result = run_with_stdout(database_url, stdout, *args)
        assert (result.returncode, result.stderr) == (
            ExitCode.ERROR,
            f"Error: cannot write to stdout: {reason}\n",
        )


@pytest.mark.parametrize("args", [("status",), ("--help",), ("--version",), ("status", "--help")])
def test_output_whose_reader_has_gone_ends_quietly(database_url: str, args: tuple[str]) -> None:
    """As ``celery-fence status | head -1`` once head has read its line: no word, and the
    status of a process that SIGPIPE ended; Click's own output (help, version) alike."""
    acquire(database_url, "job", "a")
    result = run_with_stdout(database_url, "gone", *args)
    assert (result.returncode, result.stderr) == (ExitCode.BROKEN_PIPE, "")
    assert ExitCode.BROKEN_PIPE == 128 + signal.SIGPIPE


def test_history(database_url: str) -> None:
    lease = answer(acquire(database_url, "job", "a", "--purpose", "first"))["lease"]
    cli(database_url, "release", *holder_flags(lease))
    acquire(database_url, "job", "b", "--purpose", "second")
    entries = answer(cli(database_url, "history", "job", "--json"))
    assert [(e["epoch"], e["holder"], e["end_reason"]) for e in entries] == [
        (2, "b", None),
        (1, "a", "released"),
    ]
    assert set(entries[0]) == {
        "name",
        "epoch",
        "environment",
        "holder",
        "purpose",
        "acquired_at",
        "ended_at",
        "end_reason",
    }
    assert len(answer(cli(database_url, "history", "job", "--limit", "1", "--json"))) == 1
    table = cli(database_url, "history", "job").stdout.splitlines()
    assert table[0].split() == [
        "EPOCH",
        "HOLDER",
        "ENVIRONMENT",
        "PURPOSE",
        "ACQUIRED_AT",
        "ENDED_AT",
        "END",
    ]
    assert [row.split()[:4] for row in table[1:]] == [
        ["2", "b", "default", "second"],
        ["1", "a", "default", "first"],
    ]
    assert cli(database_url, "history", "ghost").stdout == "no history for lease ghost\n"


def _stale(database_url: str, environment: str, name: str, command: str) -> None:
    """Leave one stale ``command`` (renew or release) by holder ``old`` on lease ``name``."""
    lease = answer(acquire(database_url, name, "old", environment=environment))["lease"]
    cli(database_url, "release", *holder_flags(lease))
    acquire(database_url, name, "new", environment=environment)
    ttl = ["--ttl", "30"] if command == "renew" else []
    assert cli(database_url, command, *holder_flags(lease), *ttl).exit_code == ExitCode.LOST


def test_stale_runs(database_url: str) -> None:
    assert cli(database_url, "stale-runs").stdout == "no stale runs\n"
    _stale(database_url, "prod", "p-lease", "renew")
    _stale(database_url, "test", "t-lease", "release")
    runs = answer(cli(database_url, "stale-runs", "--json"))
    assert [(r["environment"], r["lease_name"], r["action"]) for r in runs] == [
        ("test", "t-lease", "release"),
        ("prod", "p-lease", "renew"),
    ]
    assert set(runs[0]) == {
        "id",
        "recorded_at",
        "environment",
        "lease_name",
        "stale_epoch",
        "stale_holder",
        "current_epoch",
        "current_holder",
        "reason",
        "action",
        "enforced",
    }
    run = runs[1]
    assert (
        run["stale_holder"],
        run["stale_epoch"],
        run["current_holder"],
        run["current_epoch"],
    ) == (
        "old",
        1,
        "new",
        2,
    )
    assert (run["reason"], run["enforced"]) == ("superseded", True)
    assert when(run["recorded_at"]).tzinfo is not None
    prod = answer(cli(database_url, "stale-runs", "--environment", "prod", "--json"))
    assert [r["lease_name"] for r in prod] == ["p-lease"]
    by_lease = answer(cli(database_url, "stale-runs", "--lease", "t-lease", "--json"))
    assert [r["environment"] for r in by_lease] == ["test"]
    assert len(answer(cli(database_url, "stale-runs", "--limit", "1", "--json"))) == 1
    table = cli(database_url, "stale-runs", "--environment", "prod").stdout.splitlines()
    assert table[0].split() == [
        "RECORDED_AT",
        "ENVIRONMENT",
        "LEASE",
        "STALE_EPOCH",
        "STALE_HOLDER",
        "CURRENT_EPOCH",
        "CURRENT_HOLDER",
        "REASON",
        "ACTION",
        "ENFORCED",
    ]
    assert table[1].split()[1:] == [
        "prod",
        "p-lease",
        "1",
        "old",
        "2",
        "new",
        "superseded",
        "renew",
        "yes",
    ]
    nothing = cli(database_url, "stale-runs", "--environment", "nowhere")
    assert nothing.stdout == "no stale runs\n"


@pytest.mark.parametrize("command", ["renew", "release"])
def test_a_stale_run_on_a_lease_that_does_not_exist_is_listed_in_the_callers_environment(
    database_url: str, command: str
) -> None:
    ttl = ["--ttl", "30"] if command == "renew" else []
    flags = ["cli:ghost", "--epoch", "1", "--token", TOKEN, "--holder", "h", *ttl]
    result = cli(database_url, "--environment", "prod", command, *flags)
    assert_error(result, ExitCode.LOST, "missing")
    runs = answer(cli(database_url, "stale-runs", "--environment", "prod", "--json"))
    assert [(r["lease_name"], r["action"], r["reason"]) for r in runs] == [
        ("cli:ghost", command, "missing")
    ]


# -- the canary -------------------------------------------------------------------------------


def json_lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def assert_one_winner(answers: list[dict[str, Any]], clients: int, epoch: int) -> dict[str, Any]:
    """Exactly one winner at ``epoch``; every loser names it and carries no token."""
    assert len(answers) == clients
    winners = [a["lease"] for a in answers if a["acquired"]]
    assert len(winners) == 1, answers
    [won] = winners
    assert won["epoch"] == epoch
    for lost in (a for a in answers if not a["acquired"]):
        assert (lost["outcome"], lost["lease"]) == ("held", None)
        assert (lost["owner"]["holder"], lost["owner"]["epoch"]) == (won["holder"], won["epoch"])
        assert "token" not in lost["owner"]
    return won


def test_canary_script_two_clients_one_winner(database_url: str, store: LeaseStore) -> None:
    result = subprocess.run(
        [str(REPO / "scripts" / "canary")],
        env={**os.environ, "CELERY_FENCE_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "canary: OK" in result.stdout
    won = assert_one_winner(json_lines(result.stdout), clients=2, epoch=2)
    entries = store.history("canary")
    assert [(e.epoch, e.holder, e.end_reason) for e in entries] == [
        (2, won["holder"], "released"),
        (1, "canary-seed", "expired"),
    ]


def test_canary_command_with_three_clients(database_url: str, store: LeaseStore) -> None:
    result = cli(database_url, "canary", "--clients", "3", "--name", "race:three", "--ttl", "5")
    assert result.exit_code == ExitCode.OK, result.stdout + result.stderr
    won = assert_one_winner(json_lines(result.stdout), clients=3, epoch=2)
    assert result.stdout.splitlines()[-1].startswith(f"canary: OK: {won['holder']} won epoch 2")
    # What the canary prints is for others to read: the winner's token is withheld.
    assert won["token"] == "(withheld)"
    owner = store.owner("race:three")
    assert owner is not None
    assert (owner.holder, owner.epoch, owner.state) == (won["holder"], 2, "released")


def test_canary_refuses_a_lease_held_by_another(database_url: str, store: LeaseStore) -> None:
    acquire(database_url, "canary", "someone", ttl="60")
    result = cli(database_url, "canary")
    assert_error(result, ExitCode.ERROR, "lease canary is held by someone at epoch 1")
    owner = store.owner("canary")
    assert owner is not None
    assert (owner.holder, owner.epoch, owner.state) == ("someone", 1, "held")


@pytest.mark.parametrize("ttl", ["1e9", "nan", "inf"])
def test_a_canary_ttl_the_clients_would_refuse_is_bad_input_before_the_seed(
    database_url: str, store: LeaseStore, ttl: str
) -> None:
    result = cli(database_url, "canary", "--ttl", ttl)
    assert_error(result, ExitCode.USAGE, "ttl must be")
    assert result.stdout == ""
    assert store.owner("canary") is None


def test_a_canary_name_is_checked_before_the_database_is_asked() -> None:
    assert_error(cli(UNREACHABLE, "canary", "--name", " x"), ExitCode.USAGE, "lease name must not")


def test_a_canary_ttl_below_its_floor_is_bad_input_before_the_seed(
    database_url: str, store: LeaseStore
) -> None:
    """A shorter TTL could run out before the race is over: a late client would win again."""
    result = cli(database_url, "canary", "--ttl", "1")
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Error: Invalid value for '--ttl': 1.0 is not in the range x>=5." in result.stderr
    assert result.stdout == ""
    assert store.owner("canary") is None


def _owner(holder: str, epoch: int) -> Owner:
    moment = datetime(2030, 1, 1, tzinfo=timezone.utc)
    return Owner(
        name="canary",
        environment="default",
        holder=holder,
        purpose="canary",
        epoch=epoch,
        state="held",
        acquired_at=moment,
        renewed_at=moment,
        expires_at=moment,
        hold_until=moment,
        released_at=None,
        paused=False,
        paused_reason=None,
        paused_by=None,
        paused_at=None,
    )


def _won(holder: str, epoch: int) -> RaceAnswer:
    lease = {"holder": holder, "epoch": epoch, "token": str(uuid.uuid4())}
    return RaceAnswer(
        holder=holder,
        exit_code=ExitCode.OK,
        answer={"outcome": "acquired", "acquired": True, "lease": lease, "owner": None},
        error="",
    )


def _lost(holder: str, told: str, epoch: int, **owner: Any) -> RaceAnswer:
    seen = {"holder": told, "epoch": epoch, **owner}
    return RaceAnswer(
        holder=holder,
        exit_code=ExitCode.HELD,
        answer={"outcome": "held", "acquired": False, "lease": None, "owner": seen},
        error="",
    )


@pytest.mark.parametrize(
    ("answers", "current", "problem"),
    [
        ([_won("c1", 2), _won("c2", 2)], _owner("c1", 2), "expected exactly one winner, got 2"),
        ([_lost("c1", "x", 1), _lost("c2", "x", 1)], _owner("x", 1), "exactly one winner, got 0"),
        ([_won("c1", 3), _lost("c2", "c1", 3)], _owner("c1", 3), "from 1 to 3, not up by one"),
        ([_won("c1", 2), _lost("c2", "canary-seed", 1)], _owner("c1", 2), "c2 was told the owner"),
        ([_won("c1", 2), _lost("c2", "c1", 2, token="t")], _owner("c1", 2), "carries a token"),
        ([_won("c1", 2), _lost("c2", "c1", 2)], _owner("c2", 2), "the database names c2"),
        ([_won("c1", 2), _lost("c2", "c1", 2)], None, "the database names None"),
        (
            [_won("c1", 2), RaceAnswer(holder="c2", exit_code=1, answer=None, error="boom")],
            _owner("c1", 2),
            "c2 failed (exit 1): boom",
        ),
        (
            [dataclasses.replace(_won("c1", 2), exit_code=ExitCode.HELD), _lost("c2", "c1", 2)],
            _owner("c1", 2),
            "c1 failed (exit 3)",
        ),
    ],
)
def test_race_problems_finds_every_broken_promise(
    answers: list[RaceAnswer], current: Owner | None, problem: str
) -> None:
    assert race_problems(1, [_won("c1", 2), _lost("c2", "c1", 2)], _owner("c1", 2)) == []
    problems = race_problems(1, answers, current)
    assert any(problem in found for found in problems), problems


# -- the reference page -----------------------------------------------------------------------


def test_the_reference_documents_every_command_option_and_exit_code() -> None:
    text = DOCS.read_text(encoding="utf-8")
    for param in main.params:
        for opt in param.opts:
            assert f"`{opt}" in text, opt
    for name, command in main.commands.items():
        assert f"### `celery-fence {name}" in text, name
        section = text.split(f"### `celery-fence {name}", 1)[1].split("\n### ", 1)[0]
        for param in command.params:
            if isinstance(param, click.Option):
                assert any(f"`{opt}" in section for opt in param.opts), (name, param.opts)
            else:
                assert (param.name or "").upper() in section, (name, param.name)
    for code in ExitCode:
        assert re.search(rf"^\| {code.value} \| `{code.name}` \|", text, re.MULTILINE), code


@dataclasses.dataclass(frozen=True)
class Example:
    """A ``$ command`` of the page, the output the page shows after it, its exit status."""

    line: int
    command: str
    output: str
    exit_code: int


EXIT = re.compile(r"\s#\s*exit\s+(?P<code>\d+)\s*$")
# The runner makes the database and sets its URL itself; test_canary_script_two_clients_one_winner
# runs the script.
NOT_RUN_HERE = ("createdb ", "export ", "scripts/canary")


def examples(page: Path) -> list[Example]:
    """The ``$ command`` lines of the page's console blocks, in order."""
    found: list[tuple[int, str, list[str]]] = []
    language = None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            language = line[3:].strip() if language is None else None
        elif language == "console" and line.startswith("$ "):
            found.append((number, line[2:], []))
        elif language == "console" and found:
            found[-1][2].append(line)
    return [
        Example(
            line=number,
            command=command,
            output="\n".join(output),
            exit_code=int(match["code"]) if (match := EXIT.search(command)) else 0,
        )
        for number, command, output in found
    ]


def test_every_example_of_the_reference_runs_as_shown(database_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "CELERY_FENCE_DATABASE_URL": database_url}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("CELERY_FENCE_ENVIRONMENT", None)
    checker = doctest.OutputChecker()
    ran = 0
    for example in examples(DOCS):
        if example.command.startswith(NOT_RUN_HERE):
            continue
        result = subprocess.run(
            ["bash", "-c", example.command],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
            check=False,
        )
        context = f"cli.md:{example.line}: $ {example.command}\n{result.stdout}"
        assert result.returncode == example.exit_code, context
        want = example.output.strip() + "\n"
        got = result.stdout.strip() + "\n"
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        assert checker.check_output(want, got, flags), f"the page shows:\n{want}{context}"
        ran += 1
    assert ran >= 20


@pytest.mark.parametrize("option", ["--environment", "--database-url", "--version"])
def test_a_global_option_given_after_the_command_says_where_it_goes(option: str) -> None:
    result = cli(None, "pause", "release:prod", option, "prod", "--reason", "freeze")
    assert result.exit_code == ExitCode.USAGE
    assert f"No such option: {option} (one of celery-fence's own options" in result.stderr
    assert f"celery-fence {option} ... pause ..." in result.stderr


@pytest.mark.parametrize("command", ["status", "stale-runs"])
def test_a_read_given_the_global_environment_says_it_filters_nothing(
    database_url: str, command: str
) -> None:
    given = cli(database_url, "--environment", "prod", command)
    assert given.exit_code == 0, given.output
    assert f"{command} shows every environment unless given its own" in given.stderr
    assert f"(celery-fence {command} --environment prod)" in given.stderr
    # Its own filter, or the environment from the environment variable, needs no note.
    assert cli(database_url, "--environment", "prod", command, "--environment", "prod").stderr == ""
    assert cli(database_url, command, CELERY_FENCE_ENVIRONMENT="prod").stderr == ""
