"""``python -m example_app``: seed, run a worker or beat, send a release, show status, demo."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import click
import kombu.exceptions
import sqlalchemy as sa

from celery_fence import ConfigurationError, FenceError, LeaseStore
from celery_fence.contrib.celery import Fence
from example_app import data, demo, report
from example_app.celery_app import app
from example_app.tasks import ReleaseRequest, release

#: The ``celery`` arguments behind ``worker`` and ``beat``; extra arguments follow them.
CELERY_COMMANDS = {
    "worker": ("worker", "--loglevel=INFO"),
    "beat": ("beat", "-S", "fence", "--loglevel=INFO"),
}
PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True}


def store() -> LeaseStore:
    """The app's lease store, on the database the app is configured with."""
    try:
        return Fence.of(app).store
    except ConfigurationError as exc:
        raise click.ClickException(f"{exc} (set CELERY_FENCE_DATABASE_URL)") from exc


def exec_celery(command: str, extra: Sequence[str]) -> NoReturn:
    """Replace this process with ``celery -A example_app.celery_app COMMAND ...``."""
    argv = [sys.executable, "-m", "celery", "-A", "example_app.celery_app"]
    os.execv(sys.executable, [*argv, *CELERY_COMMANDS[command], *extra])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """The example document service of celery-fence."""


@cli.command()
def seed() -> None:
    """Create the app's tables and seed the documents (idempotent)."""
    count = data.seed(store().engine)
    click.echo(f"example_app: {count} documents")


@cli.command(context_settings=PASS_THROUGH, add_help_option=False)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker(celery_args: tuple[str, ...]) -> None:
    """celery -A example_app.celery_app worker --loglevel=INFO [CELERY_ARGS]"""
    exec_celery("worker", celery_args)


@cli.command(context_settings=PASS_THROUGH, add_help_option=False)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def beat(celery_args: tuple[str, ...]) -> None:
    """celery -A example_app.celery_app beat -S fence --loglevel=INFO [CELERY_ARGS]"""
    exec_celery("beat", celery_args)


@cli.command("release")
@click.argument("environment")
@click.argument("release_id")
@click.argument("commit")
@click.argument("build", type=int)
@click.option("--rollback", is_flag=True, help="Allow an older build to replace a newer one.")
def release_command(
    environment: str, release_id: str, commit: str, build: int, rollback: bool
) -> None:
    """Send a release job to the workers and print its task id."""
    try:
        ReleaseRequest.checked(environment, release_id, commit, build, rollback)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    try:
        result = release.delay(environment, release_id, commit, build, rollback=rollback)
    except kombu.exceptions.OperationalError as exc:
        with app.connection_for_write() as connection:
            url = connection.as_uri()  # without its password
        message = f"cannot send the release to the broker at {url}: {exc}"
        raise click.ClickException(message) from exc
    click.echo(f"sent release {release_id} (build {build}) to {environment}: task {result.id}")


@cli.command()
def status() -> None:
    """Leases, epochs, manifests, releases, stale runs and plans."""
    try:
        snapshot = report.take_snapshot(store())
    except (FenceError, sa.exc.ProgrammingError) as exc:
        raise click.ClickException(
            f"{str(exc).splitlines()[0]}: run `celery-fence install` and "
            "`python -m example_app seed` first"
        ) from exc
    click.echo("\n".join(report.render(snapshot)))


@cli.command("demo")
@click.option(
    "--broker", metavar="URL", help="Broker URL [default: Redis if it answers, else filesystem://]."
)
@click.option(
    "--logs",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep the workers' and beats' logs in this folder.",
)
def demo_command(broker: str | None, logs: Path | None) -> None:
    """Run the example end to end and report; exit 1 if an invariant failed."""
    try:
        code = demo.run(broker=broker, logs=logs)
    except demo.DemoFailed as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


if __name__ == "__main__":
    cli(prog_name="python -m example_app")
