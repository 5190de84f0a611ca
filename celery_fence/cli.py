"""The ``celery-fence`` command line.

It installs the schema, takes part in the lease protocol as a holder (``acquire``, ``renew``,
``release``), reads leases, ownership history and stale runs, pauses and resumes a lease, and
races a canary. Commands that change something print one JSON object on stdout; commands that
read print a table, or JSON with ``--json``. Errors are one line on stderr and an exit code from
:class:`ExitCode`: a user's mistake never shows a traceback.
"""

from __future__ import annotations

import dataclasses
import enum
import getpass
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, NoReturn, TypeVar
from uuid import UUID

import click
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_fence import validation
from celery_fence.exceptions import (
    ConfigurationError,
    FenceDatabaseError,
    FenceError,
    LeaseLostError,
    LeasePausedError,
)
from celery_fence.models import Acquisition, HistoryEntry, Lease, Owner, StaleRun
from celery_fence.store import LeaseStore, shown_url

F = TypeVar("F", bound=Callable[..., Any])
Record = TypeVar("Record", Owner, HistoryEntry, StaleRun)

# renew and release key on (name, epoch, token, holder); a lease the CLI rebuilds from those has
# no known times, and none of them is sent.
_UNKNOWN_TIME = datetime.min.replace(tzinfo=timezone.utc)
_IDENTITY = ("name", "environment", "holder", "epoch", "token", "ttl")
CANARY_SEED_HOLDER = "canary-seed"
CANARY_SEED_TTL = 1.0
#: The shortest TTL the canary's clients ask for: the race, the answers and the release of the
#: winner's lease must all fall within it.
CANARY_MIN_TTL = 5.0
BARRIER_TIMEOUT = 60.0


class ExitCode(enum.IntEnum):
    """What the exit status of ``celery-fence`` means.

    ``ERROR``: the database failed, is unreachable or lacks the schema; an unknown lease; a failed
    canary. ``USAGE``: bad input (an option, an argument, the database URL). ``HELD``: acquire
    found another holder (``held``, or ``busy`` behind fenced writers). ``PAUSED``: acquire found
    the lease paused. ``LOST``: renew or release found the lease no longer this holder's.
    ``BROKEN_PIPE``: the reader of stdout went away (as 128 + SIGPIPE, a shell's status for a
    process that signal ended).
    """

    OK = 0
    ERROR = 1
    USAGE = 2
    HELD = 3
    PAUSED = 4
    LOST = 5
    BROKEN_PIPE = 141


class CommandError(click.ClickException):
    """One line on stderr (``Error: ...``) and exit code 1."""

    exit_code = ExitCode.ERROR

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


class BadInput(CommandError):
    exit_code = ExitCode.USAGE


class PausedLease(CommandError):
    exit_code = ExitCode.PAUSED


class LostLease(CommandError):
    exit_code = ExitCode.LOST


class Unwritable(CommandError):
    """Output that stdout would not take (closed, full)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"cannot write to stdout: {reason}")


class ReaderGone(Unwritable):
    """Output whose reader went away (a broken pipe, as in ``celery-fence status | head -1``):
    it was not wanted, so no line on stderr, and exit 141."""

    exit_code = ExitCode.BROKEN_PIPE

    def show(self, file: IO[Any] | None = None) -> None:
        pass


@dataclasses.dataclass
class Settings:
    """The global options; the store is made on first use, so ``install --print`` and
    ``--help`` need no database."""

    database_url: str | None
    environment: str
    lock_timeout: float
    _store: LeaseStore | None = dataclasses.field(default=None, init=False)

    def url(self) -> str:
        if not self.database_url:
            raise BadInput("no database: pass --database-url or set CELERY_FENCE_DATABASE_URL")
        try:
            make_url(self.database_url)
        except (sa.exc.ArgumentError, ValueError) as exc:
            # The message names neither the URL nor the parser's detail: both may hold a password.
            raise BadInput("--database-url is not a valid database URL") from exc
        return self.database_url

    def store(self) -> LeaseStore:
        if self._store is None:
            self._store = LeaseStore.from_url(
                self.url(), default_environment=self.environment, lock_timeout=self.lock_timeout
            )
        return self._store

    def where(self) -> str:
        """The database URL as error messages show it (:func:`shown_url`)."""
        return shown_url(self.url())

    def close(self) -> None:
        if self._store is not None:
            self._store.engine.dispose()


def _command_error(exc: FenceError, settings: Settings) -> CommandError:
    """The one-line error and exit code for a celery-fence exception."""
    if isinstance(exc, ConfigurationError):
        return BadInput(str(exc))
    if isinstance(exc, FenceDatabaseError):
        exc.database = settings.where()  # as given, once, whoever named it first
        return CommandError(str(exc))
    if isinstance(exc, LeasePausedError):
        return PausedLease(str(exc))
    if isinstance(exc, LeaseLostError):
        return LostLease(str(exc))
    return CommandError(str(exc))


class HelpOutput(click.Command):
    """A command whose ``--help`` (and ``--version``), written while its arguments are parsed,
    fails as the commands' own output does when writing to stdout fails: one line (a full
    disk), or quietly with :attr:`ExitCode.BROKEN_PIPE` once its reader has gone
    (``celery-fence --help | head -1``), where Click would exit 1. With stdout closed, where
    Click would write nothing and exit 0, it says so."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except OSError as exc:
            raise _unwritable(exc) from exc
        except click.exceptions.Exit:
            # Only the eager options that print (help, version) end the parsing this way.
            if sys.stdout is None:
                raise Unwritable("stdout is closed") from None
            raise


class FenceCommand(HelpOutput):
    """A command whose error for one of the group's options given after its name says where
    that option goes."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            group = ctx.parent.command if ctx.parent is not None else None
            own = {
                name
                for param in (group.params if group is not None else [])
                for name in (*param.opts, *param.secondary_opts)
            }
            if exc.option_name not in own:
                raise
            raise click.NoSuchOption(
                exc.option_name,
                message=(
                    f"No such option: {exc.option_name} (one of celery-fence's own options, "
                    f"given before the command: celery-fence {exc.option_name} ... "
                    f"{ctx.info_name} ...)"
                ),
                ctx=ctx,
            ) from exc


class FenceGroup(HelpOutput, click.Group):
    """Turns every :class:`FenceError` a command raises into a one-line error."""

    command_class = FenceCommand

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FenceError as exc:
            raise _command_error(exc, ctx.obj) from exc


# -- output ------------------------------------------------------------------------------------


def _json_value(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def echo(text: str, *, nl: bool = True) -> None:
    """Write ``text`` (and a newline) on stdout, a character its encoding cannot hold escaped;
    raise :class:`Unwritable` if it cannot be written."""
    if sys.stdout is None:  # the process was started with its stdout closed
        raise Unwritable("stdout is closed")
    try:
        click.echo(text, nl=nl)
    except UnicodeEncodeError:
        # A character stdout's encoding has no form for (a name in a LANG=C terminal) is
        # written as its escape, as Python writes it in a string.
        encoding = sys.stdout.encoding or "utf-8"
        echo(text.encode(encoding, "backslashreplace").decode(encoding), nl=nl)
    except OSError as exc:
        raise _unwritable(exc) from exc


def _unwritable(exc: OSError) -> Unwritable:
    """The error for stdout that could not be written, once what it still buffers goes to the
    null device, so that the interpreter's flush at exit does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    unwritable = ReaderGone if isinstance(exc, BrokenPipeError) else Unwritable
    return unwritable(exc.strerror or str(exc))


def echo_json(data: object) -> None:
    """One JSON document on one line: datetimes in ISO 8601, UUIDs as strings."""
    echo(json.dumps(data, default=_json_value))


def _without_token(answer: dict[str, Any]) -> dict[str, Any]:
    """An acquire answer to print for others to read: the winner's token withheld."""
    lease = answer.get("lease")
    if not isinstance(lease, dict):
        return answer
    return {**answer, "lease": {**lease, "token": "(withheld)"}}


def owner_dict(owner: Owner | None) -> dict[str, Any] | None:
    return None if owner is None else dataclasses.asdict(owner)


def lease_dict(lease: Lease) -> dict[str, Any]:
    """A held lease with its token (the CLI's caller is the holder). The monotonic deadline
    means nothing to another process, and the sharer and its join time are a continuation's
    (the CLI makes none): they are left out."""
    data = dataclasses.asdict(lease)
    del data["deadline"], data["sharer"], data["joined_at"]
    return data


def acquisition_dict(got: Acquisition) -> dict[str, Any]:
    return {
        "outcome": got.outcome,
        "acquired": got.acquired,
        "lease": None if got.lease is None else lease_dict(got.lease),
        "owner": owner_dict(got.owner),
    }


def _cell(value: object) -> str:
    """``value`` as a table shows it; a character that is not printable is escaped as in a
    Python string (``\\n``, ``\\x1b``), so that no value can break a row or drive the terminal."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(value))


def _report(
    records: Sequence[Record],
    *,
    as_json: bool,
    columns: Sequence[tuple[str, Callable[[Record], object]]],
    empty: str,
) -> None:
    """Print records as JSON (a list) or as an aligned table with one row each."""
    if as_json:
        echo_json([dataclasses.asdict(record) for record in records])
        return
    if not records:
        echo(empty)
        return
    rows = [[header for header, _ in columns]]
    rows += [[_cell(column(record)) for _, column in columns] for record in records]
    widths = [max(len(row[index]) for row in rows) for index in range(len(columns))]
    for row in rows:
        echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _exit(code: ExitCode) -> NoReturn:
    click.get_current_context().exit(code)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


# -- the group ---------------------------------------------------------------------------------


@click.group(cls=FenceGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--database-url",
    envvar="CELERY_FENCE_DATABASE_URL",
    show_envvar=True,
    metavar="URL",
    help="PostgreSQL URL (postgresql:// uses psycopg 3); all but install --print need it.",
)
@click.option(
    "--environment",
    envvar="CELERY_FENCE_ENVIRONMENT",
    default="default",
    show_default=True,
    show_envvar=True,
    help="Environment of the leases this command acquires or creates paused (pause --new).",
)
@click.option(
    "--lock-timeout",
    envvar="CELERY_FENCE_LOCK_TIMEOUT",
    type=float,
    default=2.0,
    show_default=True,
    show_envvar=True,
    metavar="SECONDS",
    help="How long acquire, renew, release, pause and resume wait behind fenced writers, "
    "install for each lock its migrations take, and status, history and stale-runs for a "
    f"table that maintenance holds (at most {validation.MAX_LOCK_TIMEOUT_SECONDS:g}).",
)
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Also log acquisitions, rejections and the warnings of the libraries below on stderr.",
)
@click.version_option(package_name="celery-fence", prog_name="celery-fence")
@click.pass_context
def main(
    ctx: click.Context,
    database_url: str | None,
    environment: str,
    lock_timeout: float,
    verbose: bool,
) -> None:
    """PostgreSQL leases with fencing epochs for Celery.

    Exit codes: 0 ok, 1 error, 2 bad input, 3 lease held by another, 4 lease paused,
    5 lease lost, 141 stdout's reader gone.
    """
    try:
        validation.check_lock_timeout(lock_timeout, "--lock-timeout")
    except ConfigurationError as exc:
        raise BadInput(str(exc)) from exc
    settings = Settings(
        database_url=database_url, environment=environment, lock_timeout=lock_timeout
    )
    ctx.obj = settings
    ctx.call_on_close(settings.close)
    _route_logs(ctx, verbose)


def _route_logs(ctx: click.Context, verbose: bool) -> None:
    """The library's log lines repeat what the command prints, and psycopg's warnings (about a
    time zone it does not know, say) are noise to a command's user: both are shown only with
    ``-v``, so that an error stays one line. Other libraries' warnings are left to Python's
    default handling."""
    library = logging.getLogger("celery_fence")
    level = library.level
    if verbose:
        routed = [logging.getLogger()]
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        library.setLevel(logging.INFO)
    else:
        routed = [library, logging.getLogger("psycopg")]
        handler = logging.NullHandler()
    for logger in routed:
        logger.addHandler(handler)

    def restore() -> None:
        for logger in routed:
            logger.removeHandler(handler)
        library.setLevel(level)

    ctx.call_on_close(restore)


@main.command()
@click.option(
    "--print", "print_only", is_flag=True, help="Print the SQL instead of running it (no database)."
)
@click.pass_obj
def install(settings: Settings, print_only: bool) -> None:
    """Create or upgrade the schema (idempotent) and print its version."""
    if print_only:
        echo(LeaseStore.install_script(lock_timeout=settings.lock_timeout), nl=False)
        return
    version = settings.store().install()
    echo(f"celery-fence schema version {version}")


# -- holding a lease ---------------------------------------------------------------------------


def _line_up(store: LeaseStore, name: str, barrier: Path) -> None:
    """Connect, say ``ready.<pid>`` in ``barrier``, then wait until ``barrier/go`` exists, so
    that several processes send their acquisitions at the same moment."""
    store.owner(name)  # opens the pooled connection now: the race itself is one round trip
    ready = barrier / f"ready.{os.getpid()}"
    try:
        ready.touch()
    except OSError as exc:
        raise BadInput(f"--start-barrier: cannot create {ready}: {exc.strerror or exc}") from exc
    go = barrier / "go"
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while not go.exists():
        if time.monotonic() > deadline:
            raise CommandError(f"{go} did not appear within {BARRIER_TIMEOUT:g} s")
        time.sleep(0.001)


def _given_back(store: LeaseStore, lease: Lease) -> str:
    """Release (if it can) a lease whose token no one was told; say which it did. One this
    process no longer trusts (its TTL, less the safety margin, ran out meanwhile) is left to
    expire: its release could be a stale run."""
    what = f"lease {lease.name} epoch {lease.epoch}"
    if not lease.trusted:
        return f"{what} was won, and runs out by {_cell(lease.expires_at)} unused"
    try:
        store.release(lease)
    except FenceError as exc:
        return (
            f"{what} was won but could not be given back ({exc}): it is held until "
            f"{_cell(lease.expires_at)}"
        )
    return f"{what} was won and given back, since no one has its token"


@main.command()
@click.argument("name")
@click.option("--holder", required=True, help="Who acquires (e.g. beat@host-a).")
@click.option("--ttl", type=float, required=True, help="Seconds the lease is granted for.")
@click.option(
    "--max-hold",
    type=float,
    help="Seconds it may be held in all, renewals included [default: the longer of TTL, 1 day].",
)
@click.option("--purpose", default="", help="What the lease is for (shown to other holders).")
@click.option(
    "--wait",
    type=float,
    default=0,
    metavar="SECONDS",
    help="Keep trying this long while another holder has the lease; its release wakes the wait.",
)
@click.option(
    "--start-barrier",
    type=click.Path(exists=True, file_okay=False, writable=True, path_type=Path),
    metavar="DIR",
    help="Write DIR/ready.PID once connected, then wait for DIR/go before acquiring (races).",
)
@click.pass_obj
def acquire(
    settings: Settings,
    name: str,
    holder: str,
    ttl: float,
    max_hold: float | None,
    purpose: str,
    wait: float,
    start_barrier: Path | None,
) -> None:
    """Try to take lease NAME (once, or for up to --wait seconds); print the answer as JSON.

    The winner's answer carries the lease with its token (keep it: renew and release need it).
    A loser's answer carries the current owner, never a token. Exit 0 when acquired, 3 when
    another holder has the lease, 4 when it is paused. An answer that cannot be written gives
    the lease it won back, and exits 1.
    """
    store = settings.store()
    # Refused now: before the database is asked anything, and before every client lined up.
    store.check_acquisition(
        name, holder=holder, ttl=ttl, max_hold=max_hold, purpose=purpose, wait=wait
    )
    # A schema older than this package may grant the lease and then refuse to renew or
    # release it.
    store.check_schema(name_database=False)
    if start_barrier is not None:
        _line_up(store, name, start_barrier)
    try:
        got = store.acquire(
            name, holder=holder, ttl=ttl, max_hold=max_hold, purpose=purpose, wait=wait
        )
    except LeasePausedError as exc:
        got = Acquisition(outcome="paused", lease=None, owner=exc.owner)
    try:
        echo_json(acquisition_dict(got))
    except Unwritable as exc:
        if got.lease is None:
            raise
        raise CommandError(f"{exc.message}; {_given_back(store, got.lease)}") from exc
    if got.outcome == "paused":
        _exit(ExitCode.PAUSED)
    if not got.acquired:
        _exit(ExitCode.HELD)


def holder_options(command: F) -> F:
    """NAME and the holder's identity, as flags or as the JSON an acquire or renew printed."""
    decorators = (
        click.argument("name", required=False),
        click.option(
            "--epoch",
            type=click.IntRange(1, validation.MAX_EPOCH),
            help="The epoch acquire granted.",
        ),
        click.option("--token", help="The token acquire granted (a UUID)."),
        click.option("--holder", help="The holder that acquired."),
        click.option(
            "--lease-json",
            type=click.File("r", encoding="utf-8"),
            help="Read the lease from an acquire or renew answer in FILENAME ('-': stdin).",
        ),
    )
    for decorator in reversed(decorators):
        command = decorator(command)
    return command


def _identity_from_json(data: object) -> dict[str, Any]:
    lease = data.get("lease") if isinstance(data, dict) else None
    if not isinstance(lease, dict):
        raise BadInput(
            "--lease-json holds no lease: pass the answer of a winning acquire or of a renew"
        )
    missing = [key for key in _IDENTITY if key not in lease]
    if missing:
        raise BadInput(f"--lease-json lacks {', '.join(missing)}")
    return {key: lease[key] for key in _IDENTITY}


def _read_identity(stream: IO[str]) -> dict[str, Any]:
    try:
        data = json.load(stream)
    except UnicodeDecodeError as exc:
        raise BadInput(f"--lease-json is not UTF-8 text: {exc}") from exc
    except RecursionError as exc:
        raise BadInput("--lease-json is nested too deeply to be a lease") from exc
    except ValueError as exc:  # not JSON, or an integer too long to read
        raise BadInput(f"--lease-json is not JSON: {exc}") from exc
    return _identity_from_json(data)


def held_lease(
    *, name: str, environment: str, holder: str, epoch: object, token: object, ttl: object
) -> Lease:
    """A :class:`Lease` for renew and release, rebuilt from its holder's identity.

    Those calls send only the name, epoch, token and holder (renew also the TTL): the times are
    unknown here and stay placeholders, and the deadline counts from now. A lease rebuilt without
    a TTL (``None``: release never reads it) is not trusted for any time.
    """
    checked_epoch = validation.check_epoch(epoch)
    try:
        parsed_token = UUID(str(token))
    except ValueError as exc:
        raise ConfigurationError("token must be a UUID") from exc
    seconds = (
        0.0
        if ttl is None
        else validation.check_seconds(ttl, "ttl", maximum=validation.MAX_TTL_SECONDS)
    )
    return Lease(
        name=validation.check_name(name),
        environment=validation.check_environment(environment),
        holder=validation.check_holder(holder),
        purpose="",
        epoch=checked_epoch,
        token=parsed_token,
        acquired_at=_UNKNOWN_TIME,
        expires_at=_UNKNOWN_TIME,
        hold_until=_UNKNOWN_TIME,
        ttl=seconds,
        deadline=time.monotonic() + seconds,
    )


def _lease_from_options(
    settings: Settings,
    name: str | None,
    epoch: int | None,
    token: str | None,
    holder: str | None,
    lease_json: IO[str] | None,
    ttl: float | None,
) -> Lease:
    if lease_json is None:
        given = {"NAME": name, "--epoch": epoch, "--token": token, "--holder": holder}
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise BadInput(f"missing {', '.join(missing)} (or pass --lease-json)")
        identity: dict[str, Any] = {
            "name": name,
            "environment": settings.environment,
            "holder": holder,
            "epoch": epoch,
            "token": token,
            "ttl": ttl,
        }
    else:
        if (epoch, token, holder) != (None, None, None):
            raise BadInput("--lease-json cannot be combined with --epoch, --token or --holder")
        identity = _read_identity(lease_json)
        if name is not None and name != identity["name"]:
            raise BadInput(f"NAME {name!r} is not the lease in --lease-json ({identity['name']!r})")
        if ttl is not None:
            identity["ttl"] = ttl
    return held_lease(**identity)


@contextmanager
def _lost_answer() -> Iterator[None]:
    """On :class:`LeaseLostError`: the rejection as JSON on stdout, one line on stderr, exit 5."""
    try:
        yield
    except LeaseLostError as exc:
        echo_json(
            {
                "outcome": "lost",
                "reason": exc.reason,
                "name": exc.lease_name,
                "epoch": exc.epoch,
                "owner": owner_dict(exc.owner),
            }
        )
        raise LostLease(str(exc)) from exc


@main.command()
@holder_options
@click.option("--ttl", type=float, help="Seconds to extend to [default: the TTL in --lease-json].")
@click.pass_obj
def renew(
    settings: Settings,
    name: str | None,
    epoch: int | None,
    token: str | None,
    holder: str | None,
    lease_json: IO[str] | None,
    ttl: float | None,
) -> None:
    """Extend a held lease (never its epoch, never past its maximum hold); print it as JSON.

    Exit 5 with the reason and the current owner when the lease is no longer this holder's.
    """
    if ttl is None and lease_json is None:
        raise BadInput("missing --ttl (or pass --lease-json)")
    lease = _lease_from_options(settings, name, epoch, token, holder, lease_json, ttl)
    with _lost_answer():
        renewed = settings.store().renew(lease)
    echo_json({"outcome": "renewed", "lease": lease_dict(renewed)})


@main.command()
@holder_options
@click.pass_obj
def release(
    settings: Settings,
    name: str | None,
    epoch: int | None,
    token: str | None,
    holder: str | None,
    lease_json: IO[str] | None,
) -> None:
    """Give a held lease up at once (releasing twice is harmless).

    Exit 5 with the reason and the current owner when the lease is no longer this holder's.
    """
    lease = _lease_from_options(settings, name, epoch, token, holder, lease_json, None)
    store = settings.store()
    # A release is of the token, whatever holder it names: the answer names the lease's own, the
    # owner's when the release began (the token was granted before, and an epoch that has passed
    # is never released, so a release that succeeds is of the epoch that owner holds).
    owner = store.owner(lease.name)
    with _lost_answer():
        outcome = store.release(lease)
    assert owner is not None  # the release succeeded: the lease exists
    echo_json(
        {"outcome": outcome, "name": lease.name, "epoch": lease.epoch, "holder": owner.holder}
    )


# -- the kill switch ---------------------------------------------------------------------------


def _whoami() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (OSError, KeyError):
        return "celery-fence"


@main.command()
@click.argument("name")
@click.option("--reason", required=True, help="Why: shown to everyone who tries to acquire.")
@click.option("--by", default=_whoami, show_default="USER@HOST", help="Who pauses.")
@click.option(
    "--new",
    is_flag=True,
    help="Pause a lease no one has acquired yet (created paused); without it, a name no lease "
    "has is refused, so that a mistyped name does not pause nothing.",
)
@click.pass_obj
def pause(settings: Settings, name: str, reason: str, by: str, new: bool) -> None:
    """Stop lease NAME from being acquired or renewed; its holder's fenced writes are rejected."""
    validation.check_text(reason, "reason", max_length=validation.MAX_TEXT_LENGTH)
    validation.check_holder(by, "by (who pauses)")
    store = settings.store()
    if not new and store.owner(name) is None:
        raise CommandError(
            f"no lease named {name}: nothing paused (to pause a lease before its first "
            "acquisition, pass --new)"
        )
    owner = store.pause(name, reason=reason, by=by)
    echo_json({"outcome": "paused", "owner": owner_dict(owner)})


@main.command()
@click.argument("name")
@click.pass_obj
def resume(settings: Settings, name: str) -> None:
    """Lift the pause on lease NAME."""
    owner = settings.store().resume(name)
    echo_json({"outcome": "resumed", "owner": owner_dict(owner)})


# -- reading -----------------------------------------------------------------------------------


def _paused(owner: Owner) -> str | None:
    return f"by {owner.paused_by}: {owner.paused_reason}" if owner.paused else None


def _filter_note(environment_filter: str | None) -> None:
    """On stderr, for a read given the group's ``--environment`` on the command line and none of
    its own: that one filters nothing."""
    ctx = click.get_current_context()
    group = ctx.parent
    if (
        environment_filter is None
        and group is not None
        and group.get_parameter_source("environment") is click.core.ParameterSource.COMMANDLINE
    ):
        click.echo(
            "note: celery-fence --environment names the environment of the leases a command "
            f"acquires or creates paused; {ctx.info_name} shows every environment unless given "
            f"its own (celery-fence {ctx.info_name} --environment {group.params['environment']})",
            err=True,
        )


environment_filter = click.option(
    "--environment", "environment_filter", help="Only this environment [default: all]."
)
limit_option = click.option(
    "--limit", type=int, default=100, show_default=True, help="Most rows to show (1 to 10000)."
)


@main.command()
@click.argument("name", required=False)
@environment_filter
@json_option
@click.pass_obj
def status(
    settings: Settings, name: str | None, environment_filter: str | None, as_json: bool
) -> None:
    """Show every lease (or lease NAME) and its owner."""
    if environment_filter is not None:
        validation.check_environment(environment_filter)
    _filter_note(environment_filter)
    store = settings.store()
    if name is None:
        owners = store.leases(environment=environment_filter)
    else:
        owner = store.owner(name)
        if owner is None or environment_filter not in (None, owner.environment):
            in_environment = f" in environment {environment_filter}" if environment_filter else ""
            raise CommandError(f"no lease named {name}{in_environment}")
        owners = [owner]
    _report(
        owners,
        as_json=as_json,
        columns=(
            ("NAME", lambda o: o.name),
            ("ENVIRONMENT", lambda o: o.environment),
            ("HOLDER", lambda o: o.holder),
            ("EPOCH", lambda o: o.epoch),
            ("STATE", lambda o: o.state),
            ("EXPIRES_AT", lambda o: o.expires_at),
            ("PAUSED", _paused),
        ),
        empty="no leases",
    )


@main.command()
@click.argument("name")
@limit_option
@json_option
@click.pass_obj
def history(settings: Settings, name: str, limit: int, as_json: bool) -> None:
    """Show who won each epoch of lease NAME, newest first."""
    entries: list[HistoryEntry] = settings.store().history(name, limit=limit)
    _report(
        entries,
        as_json=as_json,
        columns=(
            ("EPOCH", lambda e: e.epoch),
            ("HOLDER", lambda e: e.holder),
            ("ENVIRONMENT", lambda e: e.environment),
            ("PURPOSE", lambda e: e.purpose),
            ("ACQUIRED_AT", lambda e: e.acquired_at),
            ("ENDED_AT", lambda e: e.ended_at),
            ("END", lambda e: e.end_reason),
        ),
        empty=f"no history for lease {name}",
    )


@main.command("stale-runs")
@environment_filter
@click.option("--lease", "lease_name", help="Only this lease.")
@limit_option
@json_option
@click.pass_obj
def stale_runs(
    settings: Settings,
    environment_filter: str | None,
    lease_name: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Show rejected stale renewals, releases and writes, newest first."""
    _filter_note(environment_filter)
    runs: list[StaleRun] = settings.store().stale_runs(
        environment=environment_filter, lease_name=lease_name, limit=limit
    )
    _report(
        runs,
        as_json=as_json,
        columns=(
            ("RECORDED_AT", lambda r: r.recorded_at),
            ("ENVIRONMENT", lambda r: r.environment),
            ("LEASE", lambda r: r.lease_name),
            ("STALE_EPOCH", lambda r: r.stale_epoch),
            ("STALE_HOLDER", lambda r: r.stale_holder),
            ("CURRENT_EPOCH", lambda r: r.current_epoch),
            ("CURRENT_HOLDER", lambda r: r.current_holder),
            ("REASON", lambda r: r.reason),
            ("ACTION", lambda r: r.action),
            ("ENFORCED", lambda r: r.enforced),
        ),
        empty="no stale runs",
    )


# -- the canary --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaceAnswer:
    """What one racing ``celery-fence acquire`` process said."""

    holder: str
    exit_code: int
    answer: dict[str, Any] | None  # its JSON answer; None when it printed none
    error: str  # its stderr


def race_problems(
    seed_epoch: int, answers: Sequence[RaceAnswer], current: Owner | None
) -> list[str]:
    """Every way a race broke the protocol's promise: exactly one winner, at the next epoch;
    every loser told that winner, and no token; the database agreeing. Empty when it held."""
    failed = [
        f"{a.holder} failed (exit {a.exit_code}): {a.error or 'no JSON answer'}"
        for a in answers
        if a.answer is None
        or a.exit_code != (ExitCode.OK if a.answer.get("acquired") else ExitCode.HELD)
    ]
    if failed:
        return failed
    replies = [(a.holder, a.answer) for a in answers if a.answer is not None]
    winners = [(holder, answer["lease"]) for holder, answer in replies if answer["acquired"]]
    if len(winners) != 1:
        return [f"expected exactly one winner, got {len(winners)}: {[h for h, _ in winners]}"]
    winner, won = winners[0]
    problems = []
    if won["epoch"] != seed_epoch + 1:
        problems.append(f"the epoch went from {seed_epoch} to {won['epoch']}, not up by one")
    for holder, answer in replies:
        if holder == winner:
            continue
        owner = answer.get("owner") or {}
        if (owner.get("holder"), owner.get("epoch")) != (won["holder"], won["epoch"]):
            problems.append(
                f"{holder} was told the owner is {owner.get('holder')} at epoch "
                f"{owner.get('epoch')}, not the winner {won['holder']} at epoch {won['epoch']}"
            )
        if answer.get("lease") is not None or "token" in owner:
            problems.append(f"{holder}'s answer carries a token")
    if current is None or (current.holder, current.epoch) != (won["holder"], won["epoch"]):
        problems.append(f"the database names {current and current.holder} as owner, not {winner}")
    return problems


def _seed(store: LeaseStore, name: str) -> Lease:
    got = store.acquire(name, holder=CANARY_SEED_HOLDER, ttl=CANARY_SEED_TTL, purpose="canary seed")
    if got.lease is None:
        owner = got.owner
        raise CommandError(
            f"lease {name} is held by {owner and owner.holder} at epoch {owner and owner.epoch} "
            f"until {owner and _cell(owner.expires_at)}; wait for it or pass another --name"
        )
    return got.lease


def _wait_until_free(store: LeaseStore, name: str) -> None:
    """Poll until the database no longer counts lease ``name`` as held."""
    deadline = time.monotonic() + CANARY_SEED_TTL + BARRIER_TIMEOUT
    while (owner := store.owner(name)) is not None and owner.held:
        if time.monotonic() > deadline:
            raise CommandError(f"lease {name} is still held after {BARRIER_TIMEOUT:g} s")
        time.sleep(0.05)


def _release_barrier(barrier: Path, clients: Sequence[subprocess.Popen[str]]) -> None:
    """Wait until every client is connected (or one has died), then let them all go."""
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while len(list(barrier.glob("ready.*"))) < len(clients):
        if any(client.poll() is not None for client in clients):
            break  # its answer says why; the others still race
        if time.monotonic() > deadline:
            raise CommandError(f"canary clients were not ready within {BARRIER_TIMEOUT:g} s")
        time.sleep(0.01)
    (barrier / "go").touch()


def _answer(holder: str, client: subprocess.Popen[str]) -> RaceAnswer:
    try:
        out, err = client.communicate(timeout=BARRIER_TIMEOUT)
    except subprocess.TimeoutExpired:
        return RaceAnswer(
            holder=holder, exit_code=-1, answer=None, error=f"no answer in {BARRIER_TIMEOUT:g} s"
        )
    try:
        answer = json.loads(out) if out.strip() else None
    except json.JSONDecodeError:
        answer = None
    return RaceAnswer(holder=holder, exit_code=client.returncode, answer=answer, error=err.strip())


def race(settings: Settings, name: str, clients: int, ttl: float) -> list[RaceAnswer]:
    """Run ``clients`` ``celery-fence acquire`` processes on lease ``name`` at once."""
    env = {
        **os.environ,
        "CELERY_FENCE_DATABASE_URL": settings.url(),
        "CELERY_FENCE_ENVIRONMENT": settings.environment,
    }
    holders = [f"canary-{number}" for number in range(1, clients + 1)]
    with tempfile.TemporaryDirectory(prefix="celery-fence-canary-") as barrier:
        command = [sys.executable, "-m", "celery_fence.cli", "acquire", name, "--ttl", repr(ttl)]
        command += ["--purpose", "canary", "--start-barrier", barrier, "--holder"]
        processes = [
            subprocess.Popen(
                [*command, holder],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for holder in holders
        ]
        try:
            _release_barrier(Path(barrier), processes)
            return [
                _answer(holder, process) for holder, process in zip(holders, processes, strict=True)
            ]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()


@main.command()
@click.option(
    "--clients",
    type=click.IntRange(2, 32),
    default=2,
    show_default=True,
    help="How many acquire processes race.",
)
@click.option("--name", default="canary", show_default=True, help="The lease to race on.")
@click.option(
    "--ttl",
    type=click.FloatRange(min=CANARY_MIN_TTL),
    default=30.0,
    show_default=True,
    help=f"TTL the racing clients ask for (at least {CANARY_MIN_TTL:g}).",
)
@click.pass_obj
def canary(settings: Settings, clients: int, name: str, ttl: float) -> None:
    """Race CLIENTS acquire processes on one expired lease and check the protocol held.

    Takes the lease for 1 s, lets it expire, starts the clients together, and checks: exactly
    one winner, the epoch up by one, every loser told the winner. Releases the lease each winner
    took, prints each JSON answer, then "canary: OK", or fails with exit 1.
    """
    store = settings.store()
    # Checked as each racing client will check it, so that a bad TTL is refused before the seed.
    validation.check_seconds(ttl, "ttl", maximum=store.max_ttl)
    validation.check_name(name)
    store.check_schema(name_database=False)
    seed = _seed(store, name)
    echo(
        f"canary: {seed.holder} holds {name} at epoch {seed.epoch} "
        f"for {CANARY_SEED_TTL:g} s; waiting"
    )
    _wait_until_free(store, name)
    echo(f"canary: {name} expired; {clients} clients race for it")
    answers = race(settings, name, clients, ttl)
    problems = race_problems(seed.epoch, answers, store.owner(name))
    winners = [a for a in answers if a.answer is not None and a.answer.get("acquired")]
    for won in winners:  # given back whatever the verdict: a failed race leaves no lease held
        assert won.answer is not None
        try:
            store.release(held_lease(**_identity_from_json(won.answer)))
        except FenceError as exc:
            if not problems:
                raise
            problems.append(f"giving back {won.holder}'s lease failed: {exc}")
    for answer in answers:  # printed once no lease is held, should stdout fail
        if answer.answer is not None:
            echo_json(_without_token(answer.answer))
    if problems:
        raise CommandError("canary: FAILED: " + "; ".join(problems))
    (winner,) = winners
    echo(
        f"canary: OK: {winner.holder} won epoch {seed.epoch + 1}; "
        f"{clients - 1} loser(s) named it as the owner; released"
    )


if __name__ == "__main__":
    main()
