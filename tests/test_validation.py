"""Bad input is refused with a ConfigurationError before any SQL is sent, and changes nothing.

The SQL functions check their own arguments too, for clients that call them directly.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from celery_fence import Acquisition, ConfigurationError, Lease, LeaseStore

BAD_TEXT = {
    "empty": "",
    "overlong": "x" * 201,
    "newline": "a\nb",
    "nul": "a\x00b",
    "leading space": " a",
    "trailing space": "a ",
    "not a string": 42,
}
BAD_SECONDS = {
    "zero": 0,
    "negative": -1,
    "below a microsecond": 1e-7,
    "nan": math.nan,
    "inf": math.inf,
    "bool": True,
    "string": "10",
    "over max_ttl": 3601,
    "beyond a float": 10**400,
}

BAD_LIMITS = (0, -1, 10_001, True, 1.5)
BAD_EPOCHS = {
    "zero": 0,
    "negative": -1,
    "over bigint": 2**63,
    "bool": True,
    "float": 1.5,
    "string": "abc",
}


def a_lease() -> Lease:
    moment = datetime(2030, 1, 1, tzinfo=timezone.utc)
    return Lease(
        name="release:prod", environment="prod", holder="h", purpose="", epoch=1,
        token=uuid.uuid4(), acquired_at=moment, expires_at=moment, hold_until=moment, ttl=10.0,
        deadline=math.inf,
    )  # fmt: skip


def acquire(**overrides: Any) -> Callable[[LeaseStore], object]:
    arguments: dict[str, Any] = {"holder": "h", "ttl": 10, "environment": "prod"}
    arguments.update(overrides)
    name = arguments.pop("name", "release:prod")
    return lambda store: store.acquire(name, **arguments)


def renew(ttl: object) -> Callable[[LeaseStore], object]:
    return lambda store: store.renew(a_lease(), ttl=ttl)  # type: ignore[arg-type]


def history(limit: object) -> Callable[[LeaseStore], object]:
    return lambda store: store.history("x", limit=limit)  # type: ignore[arg-type]


def stale_runs(limit: object) -> Callable[[LeaseStore], object]:
    return lambda store: store.stale_runs(limit=limit)  # type: ignore[arg-type]


def record_stale_run(**overrides: Any) -> Callable[[LeaseStore], object]:
    arguments: dict[str, Any] = {
        "name": "release:prod",
        "epoch": 1,
        "holder": "h",
        "reason": "expired",
        "action": "a",
        "environment": "prod",
    }
    arguments.update(overrides)
    return lambda store: store.record_stale_run(**arguments)


def with_lease(call: str, **changes: Any) -> Callable[[LeaseStore], object]:
    """``call`` (renew or release) of a lease made by hand, with ``changes`` to its fields."""
    return lambda store: getattr(store, call)(replace(a_lease(), **changes))


def rejoin(**overrides: Any) -> Callable[[LeaseStore], object]:
    arguments: dict[str, Any] = {
        "epoch": 1, "holder": "h", "mode": "join", "proof": "00", "ttl": 10, "action": "a"
    }  # fmt: skip
    arguments.update(overrides)
    return lambda store: store.rejoin("release:prod", **arguments)


def guard(action: object) -> Callable[[LeaseStore], object]:
    def call(store: LeaseStore) -> None:
        with store.engine.connect() as conn, store.guard(a_lease(), conn, action=action):  # type: ignore[arg-type]
            raise AssertionError("the body of a refused guard ran")

    return call


BAD_CALLS: dict[str, Callable[[LeaseStore], object]] = {
    **{f"acquire name {k}": acquire(name=v) for k, v in BAD_TEXT.items()},
    **{f"acquire holder {k}": acquire(holder=v) for k, v in BAD_TEXT.items()},
    **{f"acquire ttl {k}": acquire(ttl=v) for k, v in BAD_SECONDS.items()},
    "acquire environment empty": acquire(environment=""),
    "acquire environment overlong": acquire(environment="e" * 65),
    "acquire purpose newline": acquire(purpose="a\nb"),
    "acquire max_hold below ttl": acquire(ttl=10, max_hold=5),
    "acquire max_hold nan": acquire(max_hold=math.nan),
    "acquire max_hold over 7 days": acquire(max_hold=7 * 86_400 + 1),
    "acquire max_hold beyond a float": acquire(max_hold=10**400),
    **{
        f"acquire wait {k}": acquire(wait=v)
        for k, v in BAD_SECONDS.items()
        if k not in ("zero", "over max_ttl")
    },
    "acquire wait over 7 days": acquire(wait=7 * 86_400 + 1),
    "acquire wait None": acquire(wait=None),
    "acquire wait empty string": acquire(wait=""),
    "acquire wait False": acquire(wait=False),
    "acquire wait with a bad name": acquire(wait=5, name=""),
    **{f"renew ttl {k}": renew(v) for k, v in BAD_SECONDS.items()},
    "guard action empty": guard(""),
    "guard action newline": guard("publish\nmanifest"),
    "pause reason empty": lambda s: s.pause("release:prod", reason=""),
    "pause by padded": lambda s: s.pause("release:prod", reason="r", by=" ops"),
    "pause name nul": lambda s: s.pause("a\x00", reason="r"),
    "resume name empty": lambda s: s.resume(""),
    "owner name overlong": lambda s: s.owner("x" * 201),
    "history name empty": lambda s: s.history(""),
    **{f"history limit {n!r}": history(n) for n in BAD_LIMITS},
    **{f"stale_runs limit {n!r}": stale_runs(n) for n in BAD_LIMITS},
    "record_stale_run action empty": lambda s: s.record_stale_run(
        "x", epoch=1, holder="h", reason="expired", action=""
    ),
    **{
        f"record_stale_run {field} {case}": record_stale_run(**{field: value})
        for field, cases in {
            "name": {"empty": ""},
            "holder": {"empty": ""},
            "environment": {"padded": " spaced ", "empty": ""},
            "reason": {"unknown": "bogus", "not a string": 1},
            "epoch": {"zero": 0, "over bigint": 2**63, "bool": True},
        }.items()
        for case, value in cases.items()
    },
    **{f"rejoin epoch {case}": rejoin(epoch=value) for case, value in BAD_EPOCHS.items()},
    "rejoin mode unknown": rejoin(mode="take"),
    "rejoin mode not a string": rejoin(mode=1),
    "stale_runs environment not a string": lambda s: s.stale_runs(environment=5),  # type: ignore[arg-type]
    "stale_runs environment padded": lambda s: s.stale_runs(environment=" prod"),
    "stale_runs lease_name not a string": lambda s: s.stale_runs(lease_name=5),  # type: ignore[arg-type]
    "leases environment not a string": lambda s: s.leases(environment=5),  # type: ignore[arg-type]
    "rejoin proof not hex": lambda s: s.rejoin(
        "x", epoch=1, holder="h", mode="join", proof="zz", ttl=10, action="a"
    ),
    "released_by epoch zero": lambda s: s.released_by("x", since_epoch=0, holder_prefix="t@"),
    "released_by prefix empty": lambda s: s.released_by("x", since_epoch=1, holder_prefix=""),
    "released_by name empty": lambda s: s.released_by("", since_epoch=1, holder_prefix="t@"),
    "rejoin ttl nan": lambda s: s.rejoin(
        "x", epoch=1, holder="h", mode="join", proof="00", ttl=math.nan, action="a"
    ),
    "rejoin proof not a string": rejoin(proof=5),
    # A flag must be a bool: 0 would reach the database as a smallint, "no" as false.
    **{
        f"{call} {flag} {value!r}": make(value)
        for value in (0, 1, "no", None)
        for call, flag, make in (
            ("renew", "enforce", lambda v: lambda s: s.renew(a_lease(), enforce=v)),
            ("release", "enforce", lambda v: lambda s: s.release(a_lease(), enforce=v)),
            ("rejoin", "enforce", lambda v: rejoin(enforce=v)),
            ("record_stale_run", "enforced", lambda v: record_stale_run(enforced=v)),
        )
    },
    "renew not a lease": lambda s: s.renew("release:prod"),  # type: ignore[arg-type]
    "renew not a lease, with a ttl": lambda s: s.renew("release:prod", ttl=5),  # type: ignore[arg-type]
    "renew an acquisition": lambda s: s.renew(
        Acquisition(outcome="held", lease=None, owner=None)  # type: ignore[arg-type]
    ),
    "release None": lambda s: s.release(None),  # type: ignore[arg-type]
    "claim_slot not a lease": lambda s: s.claim_slot(
        None,  # type: ignore[arg-type]
        entry="e",
        slot=datetime(2030, 1, 1, tzinfo=timezone.utc),
        task="t",
    ),
    "claim_slot slot a string": lambda s: s.claim_slot(
        a_lease(),
        entry="e",
        slot="now",  # type: ignore[arg-type]
        task="t",
    ),
    "claim_slot slot naive": lambda s: s.claim_slot(
        a_lease(), entry="e", slot=datetime(2030, 1, 1), task="t"
    ),
    "rejoin delivery_prefix not a string": rejoin(delivery_prefix=123),
    "rejoin delivery_prefix with a NUL": rejoin(delivery_prefix="a\x00b"),
    "rejoin delivery_prefix overlong": rejoin(delivery_prefix="t" * 201),
    # A Lease made by hand, not by an acquisition: its fields are checked as the store's own
    # arguments are.
    **{
        f"{call} a lease whose {field} is {case}": with_lease(call, **{field: value})
        for call in ("renew", "release")
        for field, cases in {
            "epoch": {"a float": 1.0, "beyond bigint": 2**70, "zero": 0},
            "token": {"a string": "nope", "None": None},
            "name": {"with a NUL": "a\x00b", "empty": "", "not a string": 5},
            "holder": {"with a NUL": "h\x00", "not a string": None},
            "sharer": {"with a NUL": "d\x00@", "empty": "", "overlong": "d" * 201},
            "joined_at": {"naive": datetime(2030, 1, 1), "a string": "2030-01-01"},
        }.items()
        for case, value in cases.items()
    },
}


@pytest.fixture
def statements(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every statement the store's engine sends from now on (connections are opened first), and
    every connection the store takes for its own calls, which run outside the engine's events."""
    engine = store.engine
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    def recorded(method: str) -> Callable[..., Any]:
        original = getattr(store._connections, method)

        def taken(*args: Any) -> Any:
            sent.append(f"(a protocol connection: {method})")
            return original(*args)

        return taken

    for method in ("checkout", "unpooled"):
        monkeypatch.setattr(store._connections, method, recorded(method))
    sa.event.listen(engine, "before_cursor_execute", record)
    yield sent
    sa.event.remove(engine, "before_cursor_execute", record)


def row_counts(engine: Engine) -> tuple[int, int, int]:
    with engine.connect() as conn:
        counts = conn.exec_driver_sql(
            "SELECT (SELECT count(*) FROM celery_fence.leases),"
            " (SELECT count(*) FROM celery_fence.lease_history),"
            " (SELECT count(*) FROM celery_fence.stale_runs)"
        ).one()
    return (counts[0], counts[1], counts[2])


def test_bad_input_is_refused_before_any_sql(
    store: LeaseStore, statements: list[str], subtests: pytest.Subtests
) -> None:
    for case, call in BAD_CALLS.items():
        with subtests.test(case):
            with pytest.raises(ConfigurationError):
                call(store)
            assert statements == []
    assert row_counts(store.engine) == (0, 0, 0)
    # The recorder does see what the store sends: a valid call is not silent.
    statements.clear()
    store.owner("release:prod")
    assert statements


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (acquire(wait=-1), r"^wait must be 0 or more seconds, got -1$"),
        (
            lambda s: s.pause("release:prod", reason="r", by=""),
            r"^by \(who pauses\) must not be empty$",
        ),
    ],
    ids=["acquire wait negative", "pause by empty"],
)
def test_a_refusal_names_the_argument_as_the_caller_knows_it(
    store: LeaseStore, call: Callable[[LeaseStore], object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        call(store)


def test_a_schedule_entry_is_refused_by_its_own_name_when_too_long_to_record(
    store: LeaseStore, statements: list[str]
) -> None:
    """The entry's name goes into the dispatch record and into the action of a stale run; one
    that fits both is claimed, a longer one is refused as an entry before any SQL."""
    slot = datetime(2030, 1, 1, tzinfo=timezone.utc)
    # "dispatch <entry> for 2030-01-01T00:00:00.500000+00:00" is at most 500 characters,
    # whatever the slot's time.
    with pytest.raises(ConfigurationError, match=r"^entry must be at most 454 characters"):
        store.claim_slot(a_lease(), entry="e" * 455, slot=slot, task="tasks.plan")
    assert statements == []
    got = store.acquire("scheduler:plans", holder="beat", ttl=30)
    assert got.lease is not None
    for at in (slot, slot.replace(microsecond=500_000)):
        assert store.claim_slot(got.lease, entry="e" * 454, slot=at, task="tasks.plan")
    statements.clear()
    with pytest.raises(ConfigurationError, match=r"^entry must be at most 454 characters"):
        store.dispatches("scheduler:plans", entry="e" * 455)
    assert statements == []
    [latest] = store.dispatches("scheduler:plans", entry="e" * 454, limit=1)
    assert latest.slot == slot.replace(microsecond=500_000)
    assert store.dispatches("scheduler:plans", entry="e" * 453) == []
    statements.clear()
    with pytest.raises(ConfigurationError, match=r"^entry must be at most 454 characters"):
        store.latest_dispatches("scheduler:plans", ["e" * 453, "e" * 455])
    assert statements == []
    with pytest.raises(ConfigurationError, match=r"^entries must be a collection of entry names"):
        store.latest_dispatches("scheduler:plans", "e" * 454)
    assert store.latest_dispatches("scheduler:plans", []) == {}
    assert statements == []
    assert store.latest_dispatches("scheduler:plans", ["e" * 454, "e" * 453]) == {"e" * 454: latest}


BAD_STORES: dict[str, dict[str, Any]] = {
    "max_ttl zero": {"max_ttl": 0},
    "max_ttl over a day": {"max_ttl": 86_401},
    "max_ttl nan": {"max_ttl": math.nan},
    "max_ttl beyond a float": {"max_ttl": 10**400},
    "lock_timeout zero": {"lock_timeout": 0},
    "lock_timeout over a minute": {"lock_timeout": 61},
    "safety_margin one": {"safety_margin": 1},
    "safety_margin negative": {"safety_margin": -0.1},
    "safety_margin bool": {"safety_margin": True},
    "default_environment empty": {"default_environment": ""},
    "pool_size zero": {"pool_size": 0},
    "max_connections below pool_size": {"pool_size": 3, "max_connections": 2},
    "max_connections float": {"max_connections": 12.0},
    "max_connections bool": {"pool_size": 1, "max_connections": True},
    "clock not callable": {"clock": 5},
}


@pytest.mark.parametrize(
    "reading",
    [5, datetime(2030, 1, 1), "2030-01-01T00:00:00+00:00", None],
    ids=["a number", "naive", "a string", "None"],
)
def test_a_clock_that_does_not_give_an_aware_datetime_is_refused_before_any_sql(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, reading: object
) -> None:
    clocked = LeaseStore(engine, clock=lambda: reading)  # type: ignore[arg-type, return-value]
    monkeypatch.setattr(
        clocked._connections, "checkout", lambda: pytest.fail("a connection was taken")
    )
    try:
        with pytest.raises(
            ConfigurationError, match=r"^the store's clock reading must be a timezone-aware"
        ):
            clocked.acquire("release:prod", holder="h", ttl=10, environment="prod")
    finally:
        clocked.dispose()
    assert row_counts(engine) == (0, 0, 0)


@pytest.mark.parametrize("settings", BAD_STORES.values(), ids=list(BAD_STORES))
def test_impossible_store_settings_are_refused(settings: dict[str, Any]) -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(ConfigurationError):
        LeaseStore(engine, **settings)


@pytest.mark.parametrize("engine", [None, "postgresql://postgres@127.0.0.1:1/none"])
def test_a_store_needs_an_engine(engine: object) -> None:
    with pytest.raises(ConfigurationError, match=r"^LeaseStore needs a SQLAlchemy Engine, got "):
        LeaseStore(engine)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        "not a url",
        "sqlite:///fence.db",
        "mysql://user@localhost/db",
        "postgresql+nodriver://x/y",
        "postgresql+psycopg_async://user@localhost/db",
    ],
)
def test_urls_that_are_not_postgresql_on_psycopg_3_without_asyncio_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        LeaseStore.from_url(url)


def test_configuration_error_is_a_value_error_with_a_clear_message() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(ValueError, match="ttl must be finite"):
        LeaseStore(engine).acquire("x", holder="h", ttl=math.inf)


# -- the SQL functions check their arguments too --------------------------------------------------

SQL_CALLS = {
    "ttl zero": "SELECT celery_fence.acquire('x', 'prod', 'h', interval '0')",
    "ttl negative": "SELECT celery_fence.acquire('x', 'prod', 'h', interval '-1 second')",
    "ttl null": "SELECT celery_fence.acquire('x', 'prod', 'h', NULL)",
    "ttl over a day": "SELECT celery_fence.acquire('x', 'prod', 'h', interval '25 hours')",
    # Compared as it is, an interval counts a year as 360 days; added to a time, as 365.25.
    "ttl of a year less 359 days": (
        "SELECT celery_fence.acquire('x', 'prod', 'h', interval '1 year -359 days')"
    ),
    "max_hold of a year less 353 days": (
        "SELECT celery_fence.acquire('x', 'prod', 'h', interval '1 hour', "
        "interval '1 year -353 days')"
    ),
    "renew ttl of a year less 359 days": (
        "SELECT celery_fence.renew('x', 1, gen_random_uuid(), interval '1 year -359 days')"
    ),
    "name empty": "SELECT celery_fence.acquire('', 'prod', 'h', interval '10 seconds')",
    "name overlong": "SELECT celery_fence.acquire(repeat('x', 201), 'prod', 'h', interval '10 s')",
    "holder empty": "SELECT celery_fence.acquire('x', 'prod', '', interval '10 seconds')",
    "environment empty": "SELECT celery_fence.acquire('x', '', 'h', interval '10 seconds')",
    "environment null": "SELECT celery_fence.acquire('x', NULL, 'h', interval '10 seconds')",
    "release name overlong": (
        "SELECT celery_fence.release(repeat('x', 201), 1, gen_random_uuid(), 'h')"
    ),
    "pause name overlong": "SELECT celery_fence.pause(repeat('x', 5000), 'why', 'ops')",
    "pause name null": "SELECT celery_fence.pause(NULL, 'why', 'ops')",
    "pause reason empty": "SELECT celery_fence.pause('x', '', 'ops', 'prod')",
    "pause by null": "SELECT celery_fence.pause('x', 'why', NULL, 'prod')",
    "pause of a new lease without an environment": "SELECT celery_fence.pause('x', 'why', 'ops')",
    "resume name empty": "SELECT celery_fence.resume('')",
    "max_hold below ttl": (
        "SELECT celery_fence.acquire('x', 'prod', 'h', interval '10 s', interval '5 s')"
    ),
    "max_hold over 7 days": (
        "SELECT celery_fence.acquire('x', 'prod', 'h', interval '10 s', interval '8 days')"
    ),
    "renew ttl zero": ("SELECT celery_fence.renew('x', 1, gen_random_uuid(), interval '0')"),
    "rejoin bad mode": (
        "SELECT celery_fence.rejoin('x', 1, 'h', 'take', '\\x00'::bytea, interval '10 s')"
    ),
    "rejoin delivery prefix overlong": (
        "SELECT celery_fence.rejoin('x', 1, 'h', 'resume', '\\x00'::bytea, interval '10 s', "
        "p_delivery_prefix => repeat('t', 201))"
    ),
    # What only a stale run's record keeps is checked before the record is written.
    "renew holder overlong": (
        "SELECT celery_fence.renew('x', 1, gen_random_uuid(), interval '1 s', repeat('h', 201))"
    ),
    "release environment overlong": (
        "SELECT celery_fence.release('x', 1, gen_random_uuid(), 'h', "
        "p_environment => repeat('e', 65))"
    ),
    "rejoin action overlong": (
        "SELECT celery_fence.rejoin('x', 1, 'h', 'join', '\\x00'::bytea, interval '10 s', "
        "repeat('a', 501))"
    ),
    **{
        f"record_stale_run {case}": f"SELECT celery_fence.record_stale_run({arguments})"
        for case, arguments in {
            "name empty": "'', 1, 'h', 'expired', 'renew'",
            "holder overlong": "'x', 1, repeat('h', 201), 'expired', 'renew'",
            "reason unknown": "'x', 1, 'h', 'bogus', 'renew'",
            "reason null": "'x', 1, 'h', NULL, 'renew'",
            "action empty": "'x', 1, 'h', 'expired', ''",
            "action overlong": "'x', 1, 'h', 'expired', repeat('a', 501)",
            "environment empty": "'x', 1, 'h', 'expired', 'renew', ''",
            "environment overlong": "'x', 1, 'h', 'expired', 'renew', repeat('e', 65)",
        }.items()
    },
    # An injected clock the answers and the library can read.
    **{
        f"{call} at {now}": f"SELECT celery_fence.{call}({arguments}, p_now => '{now}')"
        for now in ("infinity", "-infinity", "1969-12-31 23:59+00", "9999-01-01 00:01+00")
        for call, arguments in {
            "acquire": "'x', 'prod', 'h', interval '10 s'",
            "renew": "'x', 1, gen_random_uuid(), interval '10 s'",
            "release": "'x', 1, gen_random_uuid()",
            "rejoin": "'x', 1, 'h', 'join', '\\x00'::bytea, interval '10 s'",
            "pause": "'x', 'why', 'ops', 'prod'",
            "resume": "'x'",
            "owner": "'x'",
            "check_fence": "'x', 1, gen_random_uuid()",
            "fence": "'x', 1, gen_random_uuid()",
            "record_stale_run": "'x', 1, 'h', 'expired', 'renew', 'prod'",
        }.items()
    },
}


@pytest.mark.parametrize("call", ["renew", "release"])
def test_a_stale_call_without_a_holder_from_sql_is_answered_and_recorded(
    engine: Engine, call: str
) -> None:
    arguments = (
        "'x', 1, gen_random_uuid(), interval '9 s', NULL"
        if call == "renew"
        else ("'x', 1, gen_random_uuid(), NULL")
    )
    with engine.begin() as conn:
        answer = conn.exec_driver_sql(
            f"SELECT outcome, reason FROM celery_fence.{call}({arguments})"
        ).one()
        holder = conn.exec_driver_sql("SELECT stale_holder FROM celery_fence.stale_runs").one()
    assert tuple(answer) == ("lost", "missing")
    assert tuple(holder) == ("",)


@pytest.mark.parametrize(
    "statement",
    [
        "celery_fence.renew('x', 1, gen_random_uuid(), interval '9 s', 'h', NULL)",
        "celery_fence.release('x', 1, gen_random_uuid(), 'h', NULL)",
        "celery_fence.rejoin('x', 1, 'h', 'join', '\\x00'::bytea, interval '9 s', 'start', NULL)",
        "celery_fence.record_stale_run('x', 1, 'h', 'forged', 'start', 'prod', NULL)",
    ],
    ids=["renew", "release", "rejoin", "record_stale_run"],
)
def test_a_stale_run_recorded_from_sql_without_p_enforced_is_enforced(
    engine: Engine, statement: str
) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"SELECT {statement}")
        enforced = conn.exec_driver_sql("SELECT enforced FROM celery_fence.stale_runs").scalar_one()
    assert enforced is True


@pytest.mark.parametrize(
    "call",
    [
        "renew(l.name, l.epoch, l.token, interval '1 s', 'h', p_environment => '')",
        "release(l.name, l.epoch, l.token, repeat('h', 201))",
        "rejoin(l.name, l.epoch, l.holder, 'join', '\\x00'::bytea, interval '1 s', '')",
    ],
    ids=["renew environment empty", "release holder overlong", "rejoin action empty"],
)
def test_what_only_a_stale_run_keeps_is_refused_also_when_the_call_is_not_stale(
    store: LeaseStore, engine: Engine, call: str
) -> None:
    """The same call is refused whether the lease still holds or not, not only once it turns
    out stale and must be recorded."""
    lease = store.acquire("release:prod", holder="h", ttl=60, environment="prod").lease
    assert lease is not None
    with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as conn:
        conn.exec_driver_sql(f"SELECT celery_fence.{call} FROM celery_fence.leases l")
    assert isinstance(caught.value.orig, psycopg.errors.InvalidParameterValue)
    owner = store.owner("release:prod")
    assert owner is not None
    assert (owner.state, owner.expires_at) == ("held", lease.expires_at)


@pytest.mark.parametrize("statement", SQL_CALLS.values(), ids=list(SQL_CALLS))
def test_sql_functions_refuse_bad_arguments(engine: Engine, statement: str) -> None:
    with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as conn:
        conn.exec_driver_sql(statement)
    assert isinstance(caught.value.orig, psycopg.errors.InvalidParameterValue)
    assert caught.value.orig.sqlstate == "22023"
    assert row_counts(engine) == (0, 0, 0)
