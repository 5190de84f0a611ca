"""Least privilege as ``docs/how-to/least-privilege.md`` has it: the page is the one list of
grants. Its SQL blocks run here with role and database names of this test's own: an owner
installs the schema, a runtime role gets exactly the page's grants and can then do everything
the library does; each of those grants is needed, and a role without them is refused."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import make_url
from test_docs import DOCS, blocks

from celery_fence import FenceDatabaseError, LeaseLostError, LeaseStore, StaleEpochError
from celery_fence.cli import main
from celery_fence.store import proof

PAGE = DOCS / "how-to" / "least-privilege.md"
OWNER, RUNTIME, READER = "celery_fence_owner", "celery_fence_app", "celery_fence_reader"
_GRANT = re.compile(r"^GRANT (?P<privileges>.+?) ON (?P<object>.+?) TO (?P<role>\w+);$")


def grants(audience: str) -> str:
    """The SQL block of the page marked ``<!-- grants: AUDIENCE -->``."""
    (block,) = [b for b in blocks(PAGE) if b.marker == f"grants: {audience}"]
    return block.body


@dataclass(frozen=True)
class Roles:
    """The page's roles under names of this test's own, in the test's database."""

    names: dict[str, str]
    database: str
    url: sa.URL

    def sql(self, text: str) -> str:
        """The page's SQL with this test's role and database names."""
        for page_name, name in self.names.items():
            text = re.sub(rf"\b{page_name}\b", f'"{name}"', text)
        return re.sub(r"\bDATABASE app\b", f'DATABASE "{self.database}"', text)

    def url_for(self, role: str) -> str:
        return self.url.set(username=self.names[role]).render_as_string(hide_password=False)

    def run_as(self, role: str | None, text: str) -> None:
        """Run ``text`` (the page's SQL) as ``role`` (``None``: the test's superuser)."""
        url = self.url if role is None else make_url(self.url_for(role))
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        try:
            with engine.begin() as conn:
                for statement in filter(str.strip, self.sql(text).split(";")):
                    conn.exec_driver_sql(statement)
        finally:
            engine.dispose()


@pytest.fixture
def roles(empty_database_url: str) -> Iterator[Roles]:
    """The owner and the runtime role of the page, plus ``nobody`` (a login and nothing
    else), created in the test's empty database and dropped after the test."""
    suffix = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = make_url(empty_database_url)
    names = {
        OWNER: f"cf_owner_{suffix}",
        RUNTIME: f"cf_app_{suffix}",
        READER: f"cf_ro_{suffix}",
        "nobody": f"cf_no_{suffix}",
    }
    made = Roles(names=names, database=str(url.database), url=url)
    made.run_as(
        None, grants("superuser") + f"CREATE ROLE {READER} LOGIN; CREATE ROLE nobody LOGIN;"
    )
    try:
        yield made
    finally:
        made.run_as(None, f"DROP OWNED BY {', '.join(names)} CASCADE;")
        made.run_as(None, "".join(f"DROP ROLE {name};" for name in names))


@pytest.fixture
def installed(roles: Roles) -> Roles:
    """The page's steps 2 and 3: ``celery-fence install`` as the owner, then its grants."""
    result = CliRunner().invoke(main, ["--database-url", roles.url_for(OWNER), "install"])
    assert result.exit_code == 0, result.output
    roles.run_as(OWNER, grants("owner"))
    return roles


@pytest.fixture
def store_as() -> Iterator[Callable[[str], LeaseStore]]:
    stores: list[LeaseStore] = []

    def make(url: str) -> LeaseStore:
        stores.append(LeaseStore.from_url(url, default_environment="prod"))
        return stores[-1]

    yield make
    for store in stores:
        store.engine.dispose()


def exercise(store: LeaseStore, name: str) -> None:
    """Everything the library does with the database, as one role: the start-up check,
    acquire, renew, a fenced write, pause and resume, release, a rejected stale renewal and a
    rejected stale write and their records, a continuation joining the lease (checked, and as a
    delivery that shares it and leaves), a beat slot claim, and every read."""
    store.check_schema()
    got = store.acquire(name, holder="deploy-1", ttl=30, purpose="release 42")
    assert got.lease is not None, got
    lease = store.renew(got.lease)
    with store.engine.begin() as conn, store.guard(lease, conn, action="publish manifest"):
        conn.execute(sa.text("SELECT 1"))
    joined = store.rejoin(
        name,
        epoch=lease.epoch,
        holder=lease.holder,
        mode="join",
        proof=proof(lease, "join"),
        ttl=30,
        action="start child",
    )
    assert joined.outcome == "joined"
    assert joined.lease is None
    resume = {"epoch": lease.epoch, "holder": lease.holder, "mode": "resume", "ttl": 30}
    resume |= {"proof": proof(lease, "resume"), "action": "start child"}
    child = store.rejoin(name, **resume, delivery_prefix="child[1]@")
    assert child.lease is not None, child
    assert store.rejoin(name, **resume, delivery_prefix="child[1]@").outcome == "shared"
    assert store.release(child.lease) == "left"
    slot = datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert store.claim_slot(lease, entry="plan", slot=slot, task="tasks.plan")
    assert [d.entry for d in store.dispatches(name)] == ["plan"]
    assert [d.slot for d in store.latest_dispatches(name, ["plan"]).values()] == [slot]
    store.release(lease)
    with pytest.raises(LeaseLostError):
        store.renew(lease)  # recorded by the protocol function itself
    with (
        pytest.raises(StaleEpochError),
        store.engine.begin() as conn,
        store.guard(lease, conn, action="late publish"),
    ):
        conn.execute(sa.text("SELECT 1"))
    records = store.stale_runs(lease_name=name)
    assert [(run.action, run.reason) for run in records] == [
        ("late publish", "released"),
        ("renew", "released"),
    ]
    assert [entry.end_reason for entry in store.history(name)] == ["released"]
    assert store.released_by(name, since_epoch=lease.epoch, holder_prefix="deploy-")
    store.pause(name, reason="investigating", by="ops")
    assert store.resume(name).paused is False
    assert store.owner(name) is not None
    assert name in [owner.name for owner in store.leases()]


def test_the_page_grants_the_runtime_role_everything_it_needs(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    exercise(store_as(installed.url_for(RUNTIME)), "release:prod")
    result = CliRunner().invoke(
        main, ["--database-url", installed.url_for(RUNTIME), "status", "release:prod"]
    )
    assert result.exit_code == 0, result.output
    assert "release:prod" in result.output


def test_the_runtime_role_owns_nothing_and_cannot_install(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    url = make_url(installed.url_for(OWNER)).set(drivername="postgresql+psycopg")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        owners = conn.execute(
            sa.text(
                "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'celery_fence'"
            )
        ).scalars()
        assert set(owners) == {installed.names[OWNER]}
    engine.dispose()
    with pytest.raises(FenceDatabaseError, match="permission denied"):
        store_as(installed.url_for(RUNTIME)).install()


def test_every_grant_of_the_page_is_needed(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    """Revoke one privilege at a time: something the library does must then be refused."""
    store = store_as(installed.url_for(RUNTIME))
    privileges = [
        (privilege.strip(), match["object"])
        for line in grants("owner").splitlines()
        if (match := _GRANT.match(line.strip()))
        for privilege in match["privileges"].split(",")
    ]
    assert len(privileges) == 14, privileges
    for privilege, target in privileges:
        statement = f"{privilege} ON {target} {{}} {RUNTIME};"
        installed.run_as(OWNER, "REVOKE " + statement.format("FROM"))
        with pytest.raises(FenceDatabaseError, match="permission denied"):
            exercise(store, f"job:{privilege}:{target}".replace(" ", "_"))
        installed.run_as(OWNER, "GRANT " + statement.format("TO"))
    exercise(store, "job:all-granted")


def test_a_reader_reads_history_stale_runs_and_dispatches_but_no_token(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    exercise(store_as(installed.url_for(RUNTIME)), "release:prod")
    installed.run_as(OWNER, grants("reader"))
    reader = store_as(installed.url_for(READER))
    assert [entry.end_reason for entry in reader.history("release:prod")] == ["released"]
    assert [run.reason for run in reader.stale_runs()] == ["released", "released"]
    assert [d.entry for d in reader.dispatches("release:prod")] == ["plan"]
    for command in (["history", "release:prod"], ["stale-runs"]):
        result = CliRunner().invoke(main, ["--database-url", installed.url_for(READER), *command])
        assert result.exit_code == 0, result.output
    with pytest.raises(sa.exc.ProgrammingError, match="permission denied for table leases"):
        installed.run_as(READER, "SELECT token FROM celery_fence.leases;")
    with pytest.raises(FenceDatabaseError, match="permission denied"):
        reader.leases()


def test_a_role_without_the_grants_is_refused(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    store = store_as(installed.url_for("nobody"))
    with pytest.raises(FenceDatabaseError, match="permission denied for schema celery_fence"):
        store.acquire("release:prod", holder="intruder", ttl=30)
    with pytest.raises(FenceDatabaseError, match="permission denied"):
        store.stale_runs()


#: What a role may create where any role may create objects in ``public`` (PostgreSQL 14 and
#: older): a closer match than PostgreSQL's own for a function and an operator the protocol
#: uses (``make_interval(secs double precision)``, ``numeric * numeric``), each leaving a trace.
HIJACKS = """
CREATE TABLE public.hijacked (what text);
GRANT SELECT, INSERT ON public.hijacked TO PUBLIC;
CREATE FUNCTION public.make_interval(secs numeric) RETURNS interval LANGUAGE sql
    AS $$ INSERT INTO public.hijacked VALUES ('make_interval') RETURNING interval '1 day' $$;
CREATE FUNCTION public.times(numeric, integer) RETURNS numeric LANGUAGE sql
    AS $$ INSERT INTO public.hijacked VALUES ('*') RETURNING 1::numeric $$;
CREATE OPERATOR public.* (LEFTARG = numeric, RIGHTARG = integer, FUNCTION = public.times);
"""


def test_what_another_role_puts_on_the_search_path_is_not_called(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    installed.run_as(None, "GRANT CREATE ON SCHEMA public TO nobody;")
    installed.run_as("nobody", HIJACKS)
    engine = sa.create_engine(installed.url, poolclass=sa.NullPool)

    def hijacked() -> list[str]:
        with engine.begin() as conn:
            return list(
                conn.exec_driver_sql("DELETE FROM public.hijacked RETURNING what").scalars()
            )

    try:
        # Names left to a search path with public on it (every role's default) find them.
        installed.run_as(RUNTIME, "SELECT make_interval(secs => 1.5), 1.5 * 2;")
        assert sorted(hijacked()) == ["*", "make_interval"]

        result = CliRunner().invoke(main, ["--database-url", installed.url_for(OWNER), "install"])
        assert result.exit_code == 0, result.output
        exercise(store_as(installed.url_for(RUNTIME)), "release:prod")
        installed.run_as(
            RUNTIME,
            "SELECT celery_fence.acquire('psql:job', 'prod', 'dba', interval '30 seconds');"
            "SELECT celery_fence.argument_error('psql:job', 'dba', interval '1 s', NULL);",
        )
        assert hijacked() == []
    finally:
        engine.dispose()


def test_a_connection_refused_while_sqlalchemy_sets_it_up_gives_the_librarys_error(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    """A store opens its connections through SQLAlchemy, whose dialect runs queries of its own
    on the first one; an error there is a database error of the call, as any other, and one line
    from the CLI."""
    installed.run_as(None, "REVOKE EXECUTE ON FUNCTION pg_catalog.version() FROM PUBLIC;")
    with pytest.raises(FenceDatabaseError, match="permission denied for function version"):
        store_as(installed.url_for(RUNTIME)).owner("release:prod")
    result = CliRunner().invoke(main, ["--database-url", installed.url_for(RUNTIME), "status"])
    assert result.exit_code == 1
    assert result.output.startswith(
        "Error: database error: permission denied for function version [database "
    )
    assert result.output.count("\n") == 1


def test_a_failed_canary_race_leaves_no_lease_held(
    installed: Roles, store_as: Callable[[str], LeaseStore]
) -> None:
    """Clients the server turns away fail the race; the one that won gives its lease back all
    the same."""
    installed.run_as(None, f"ALTER ROLE {RUNTIME} CONNECTION LIMIT 2;")
    url = installed.url_for(RUNTIME)
    result = CliRunner().invoke(main, ["--database-url", url, "canary", "--clients", "4"])
    assert result.exit_code == 1
    assert "canary: FAILED: " in result.output
    assert "too many connections" in result.output
    installed.run_as(None, f"ALTER ROLE {RUNTIME} CONNECTION LIMIT -1;")
    owner = store_as(url).owner("canary")
    assert owner is not None
    assert not owner.held, owner
