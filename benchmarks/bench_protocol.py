"""The lease protocol's cost, measured against raw SQL sent through psycopg alone.

    .venv/bin/python benchmarks/bench_protocol.py [--database-url URL] [--rounds N] [--check]

Creates a scratch database (``bench_...``) on the server, installs celery-fence there, and
drops it at the end. Each round runs every single-connection variant once, in a shuffled
order, so that the machine's noise falls on all of them alike; the raw SQL and the library's
calls share one autocommit connection, the store's own; every ``--race-every`` rounds,
32 threads of this process (each on its own connection) race for one free lease behind a
barrier: through ``LeaseStore.acquire``, calling ``celery_fence.acquire()`` directly, and with
the raw one-statement acquisition; and they ask at once for a lease someone else holds (the
floor for 32 simultaneous requests from one interpreter). 32 processes, each with a
``LeaseStore`` of its own, run the same two races through ``LeaseStore.acquire``, free of
this process's interpreter lock. It prints medians and p99s, the ratios the protocol promises
with PASS or MISS, and where the library's time goes; with ``--check`` a miss makes the exit
status non-zero.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench_common import Samples, add_database_url, percentile, scratch_database, server_version
from celery_fence import Lease, LeaseStore

CONTENDERS = 32
HOLDER = "bench@host-a"
HELD = "bench:held"
# How long a process contender, or this process, waits at a barrier before giving up: long
# enough for 32 interpreters to start on two cores.
BARRIER_TIMEOUT = 120.0
T = TypeVar("T")

SETUP = """
CREATE TABLE raw_leases (
    name        text        PRIMARY KEY,
    holder      text        NOT NULL,
    epoch       bigint      NOT NULL,
    token       uuid        NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
) WITH (fillfactor = 70);
CREATE TABLE counters (id integer PRIMARY KEY, n bigint NOT NULL);
CREATE TABLE work (id integer PRIMARY KEY, n bigint NOT NULL);
INSERT INTO work VALUES (1, 0);
"""

# The whole acquisition in one statement: insert, or take over an expired row (ttl 0 keeps
# every round a winning one), epoch + 1, new token.
RAW_ACQUIRE = """
INSERT INTO raw_leases AS l (name, holder, epoch, token, acquired_at, expires_at)
VALUES (%s, %s, 1, gen_random_uuid(), clock_timestamp(),
        clock_timestamp() + make_interval(secs => %s))
ON CONFLICT (name) DO UPDATE SET
    holder = excluded.holder, epoch = l.epoch + 1, token = excluded.token,
    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
WHERE l.expires_at <= clock_timestamp()
RETURNING l.epoch, l.token, l.expires_at
"""
# The protocol's own write alone: the update that takes a released lease row over, without the
# look before it, the advisory lock, the argument checks or the answer.
BARE_TAKEOVER = """
UPDATE celery_fence.leases AS l SET
    holder = %s, epoch = l.epoch + 1, token = gen_random_uuid(),
    acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
    expires_at = clock_timestamp() + interval '60 seconds',
    hold_until = clock_timestamp() + interval '1 day', released_at = NULL, sharers = 1
WHERE l.name = %s AND NOT l.paused
  AND (l.released_at IS NOT NULL OR l.expires_at <= clock_timestamp())
RETURNING l.epoch, l.token
"""
UPSERT = """
INSERT INTO counters AS c (id, n) VALUES (1, 1)
ON CONFLICT (id) DO UPDATE SET n = c.n + 1
"""
SQL_ACQUIRE = """
SELECT epoch, token FROM celery_fence.acquire(%s, 'default', %s, make_interval(secs => 60))
"""
SQL_RELEASE = "SELECT outcome FROM celery_fence.release(%s, %s, %s, %s)"
EXPIRE_RAW = "UPDATE raw_leases SET expires_at = clock_timestamp() WHERE name = %s"
UPDATE_WORK = sa.text("UPDATE work SET n = n + 1 WHERE id = 1")

LABELS = {
    "upsert": "reference: single-row upsert + commit (psycopg)",
    "select1": "reference: SELECT 1, one round trip (psycopg)",
    "raw": "raw one-statement acquire, winning (psycopg)",
    "bare": "the lease row's takeover UPDATE alone, winning (psycopg)",
    "sql_win": "celery_fence.acquire() called directly, winning (psycopg)",
    "lib_win": "LeaseStore.acquire, winning",
    "lib_lose": "LeaseStore.acquire, losing (lease held)",
    "unguarded": "transaction: UPDATE one row + commit (SQLAlchemy)",
    "guarded": "the same transaction under store.guard (SQLAlchemy)",
    "race_library_win": f"LeaseStore.acquire, {CONTENDERS} threads: the winner",
    "race_library_lose": f"LeaseStore.acquire, {CONTENDERS} threads: the losers",
    "race_sql_win": f"celery_fence.acquire(), {CONTENDERS} threads: the winner",
    "race_sql_lose": f"celery_fence.acquire(), {CONTENDERS} threads: the losers",
    "race_raw_win": f"raw one-statement acquire, {CONTENDERS} threads: the winner",
    "race_raw_lose": f"raw one-statement acquire, {CONTENDERS} threads: the losers",
    "race_held_lose": f"LeaseStore.acquire, {CONTENDERS} threads on a held lease (no lock)",
    "race_process_win": f"LeaseStore.acquire, {CONTENDERS} processes: the winner",
    "race_process_lose": f"LeaseStore.acquire, {CONTENDERS} processes: the losers",
    "race_process_held_lose": (
        f"LeaseStore.acquire, {CONTENDERS} processes on a held lease (no lock)"
    ),
}


@dataclass(frozen=True)
class Target:
    label: str
    numerator: str
    denominator: str
    limit: float
    use_p99: bool = False


TARGETS = (
    Target("library acquire / raw one-statement acquire", "lib_win", "raw", 1.25),
    Target("losing acquire / winning acquire", "lib_lose", "lib_win", 0.70),
    Target("guarded transaction / unguarded transaction", "guarded", "unguarded", 1.35),
    Target(
        f"{CONTENDERS} contender threads: losers' p99 / uncontended acquire",
        "race_library_lose",
        "lib_win",
        5.0,
        use_p99=True,
    ),
    Target(
        f"{CONTENDERS} contender processes: losers' p99 / uncontended acquire",
        "race_process_lose",
        "lib_win",
        5.0,
        use_p99=True,
    ),
)

THREAD_RACES = ("library", "sql", "raw", "held")
# The races of the process contenders, and the lease each is run on.
PROCESS_RACES = {"process": "bench:race-process", "process_held": HELD}
ON_HELD = frozenset({"held", "process_held"})
STOP = -1


class Bench:
    """The connections, stores and samples of one run."""

    def __init__(self, url: URL) -> None:
        self.url = url
        # One protocol connection, kept: the library's calls and the SQL sent through psycopg
        # alone all run on it, and so find the same server process equally warm.
        self.store = LeaseStore.from_url(url.render_as_string(hide_password=False), pool_size=1)
        self.cursor: psycopg.Cursor[tuple[object, ...]] | None = None
        self.driver(None, SETUP, fetch=False)
        self.engine = self.store.engine
        self.samples: Samples = {key: [] for key in LABELS}
        self.held = self._take(HELD, "bench@host-b")
        self.guard_lease = self._take("bench:guard", HOLDER)
        self.store.release(self._take("bench:bare", HOLDER))

    def _take(self, name: str, holder: str) -> Lease:
        got = self.store.acquire(name, holder=holder, ttl=3600)
        assert got.lease is not None, got
        return got.lease

    def timed(self, key: str, call: Callable[[], T]) -> T:
        started = time.perf_counter()
        result = call()
        self.samples[key].append(time.perf_counter() - started)
        return result

    def driver(
        self, key: str | None, query: str, params: tuple[object, ...] = (), *, fetch: bool = True
    ) -> tuple[object, ...] | None:
        """Send ``query`` through psycopg alone, on the store's connection, with one cursor
        reused as the store reuses its own; timed under ``key`` unless it is None. Its row when
        ``fetch``."""
        with self.store.protocol_connection() as connection:
            if self.cursor is None or self.cursor.connection is not connection:
                self.cursor = connection.cursor()
            cursor = self.cursor

            def send() -> tuple[object, ...] | None:
                cursor.execute(query, params)
                row: tuple[object, ...] | None = cursor.fetchone() if fetch else None
                return row

            return send() if key is None else self.timed(key, send)

    def sql_release(self, name: str, epoch: object, token: object, holder: str) -> None:
        self.driver(None, SQL_RELEASE, (name, epoch, token, holder))

    def expire_raw_race(self) -> None:
        self.driver(None, EXPIRE_RAW, ("bench:race-raw",), fetch=False)

    def record(self, kind: str, outcomes: Sequence[tuple[float, bool]]) -> None:
        """Keep one race's timings, each contender's as a win or a loss. On a free lease exactly
        one contender must win; on a held one, none."""
        winners = sum(won for _, won in outcomes)
        expected = 0 if kind in ON_HELD else 1
        assert winners == expected, f"{winners} contenders won a {kind} race"
        for seconds, won in outcomes:
            self.samples[f"race_{kind}_{'win' if won else 'lose'}"].append(seconds)

    # -- the variants: each times one call and resets what it needs untimed --------------------

    def upsert(self) -> None:
        self.driver("upsert", UPSERT, fetch=False)

    def select1(self) -> None:
        self.driver("select1", "SELECT 1")

    def raw_acquire(self) -> None:
        row = self.driver("raw", RAW_ACQUIRE, ("bench:raw", HOLDER, 0))
        assert row is not None, "the raw acquisition lost"

    def bare_takeover(self) -> None:
        row = self.driver("bare", BARE_TAKEOVER, (HOLDER, "bench:bare"))
        assert row is not None, "the bare takeover found the lease held"
        self.sql_release("bench:bare", row[0], row[1], HOLDER)

    def sql_acquire(self) -> None:
        row = self.driver("sql_win", SQL_ACQUIRE, ("bench:sql", HOLDER))
        assert row is not None, "celery_fence.acquire() returned no row"
        assert row[1] is not None, "celery_fence.acquire() lost a free lease"
        self.sql_release("bench:sql", row[0], row[1], HOLDER)

    def library_win(self) -> None:
        got = self.timed("lib_win", lambda: self.store.acquire("bench:win", holder=HOLDER, ttl=60))
        assert got.lease is not None, "LeaseStore.acquire lost a free lease"
        self.store.release(got.lease)

    def library_lose(self) -> None:
        got = self.timed("lib_lose", lambda: self.store.acquire(HELD, holder=HOLDER, ttl=60))
        assert got.outcome == "held", got

    def unguarded(self) -> None:
        def transaction() -> None:
            with self.engine.begin() as conn:
                conn.execute(UPDATE_WORK)

        self.timed("unguarded", transaction)

    def guarded(self) -> None:
        def transaction() -> None:
            with (
                self.engine.begin() as conn,
                self.store.guard(self.guard_lease, conn, action="bench"),
            ):
                conn.execute(UPDATE_WORK)

        self.timed("guarded", transaction)

    def variants(self) -> list[Callable[[], None]]:
        return [
            self.upsert,
            self.select1,
            self.raw_acquire,
            self.bare_takeover,
            self.sql_acquire,
            self.library_win,
            self.library_lose,
            self.unguarded,
            self.guarded,
        ]

    def close(self) -> None:
        self.store.dispose()


def contender_store(url: str) -> LeaseStore:
    """A racer's store: its protocol calls on one connection of its own, opened before anything
    is timed."""
    store = LeaseStore.from_url(url, pool_size=1)
    store.owner(HELD)
    return store


def timed_acquire(
    store: LeaseStore, name: str, holder: str, go: threading.Barrier
) -> tuple[float, Lease | None]:
    """Wait at ``go`` with the other racers, then time ``store.acquire`` alone."""
    go.wait()
    started = time.perf_counter()
    got = store.acquire(name, holder=holder, ttl=60)
    return time.perf_counter() - started, got.lease


class Contender(threading.Thread):
    """One racer on a connection of its own, reused for every race: through the library, or
    sending SQL on that same connection through psycopg alone."""

    def __init__(self, race: Race, index: int) -> None:
        super().__init__(daemon=True)
        self.race = race
        self.holder = f"contender-{index}"
        self.store = contender_store(race.bench.url.render_as_string(hide_password=False))
        self.seconds = 0.0
        self.won: Callable[[], None] | None = None

    def library(self, name: str) -> None:
        self.seconds, lease = timed_acquire(self.store, name, self.holder, self.race.go)
        self.won = None if lease is None else lambda: self.store.release(lease)

    def on_driver(self, query: str, params: tuple[object, ...]) -> tuple[object, ...] | None:
        """Run ``query`` through psycopg alone on this contender's (autocommit) connection,
        timed."""
        with self.store.protocol_connection() as connection:
            assert isinstance(connection, psycopg.Connection)
            self.race.go.wait()
            started = time.perf_counter()
            row: tuple[object, ...] | None = connection.execute(query, params).fetchone()
            self.seconds = time.perf_counter() - started
        return row

    def sql(self) -> None:
        row = self.on_driver(SQL_ACQUIRE, ("bench:race-sql", self.holder))
        assert row is not None, "celery_fence.acquire() returned no row"
        epoch, token = row
        bench = self.race.bench
        self.won = (
            None
            if token is None
            else lambda: bench.sql_release("bench:race-sql", epoch, token, self.holder)
        )

    def raw(self) -> None:
        row = self.on_driver(RAW_ACQUIRE, ("bench:race-raw", self.holder, 60))
        self.won = None if row is None else self.race.bench.expire_raw_race

    def run(self) -> None:
        races = {
            "library": lambda: self.library("bench:race"),
            "held": lambda: self.library(HELD),
            "sql": self.sql,
            "raw": self.raw,
        }
        while True:
            self.race.start.wait()
            if self.race.kind == "stop":
                return
            races[self.race.kind]()
            self.race.done.wait()


class Race:
    """``CONTENDERS`` threads of this process released by a barrier onto one lease."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.kind = "library"
        self.start = threading.Barrier(CONTENDERS + 1)
        self.go = threading.Barrier(CONTENDERS)
        self.done = threading.Barrier(CONTENDERS + 1)
        self.contenders = [Contender(self, index) for index in range(CONTENDERS)]
        for contender in self.contenders:
            contender.start()

    def run(self, kind: str) -> None:
        """One race of ``kind``. On a free lease ("library", "sql", "raw") exactly one wins
        and then gives the lease up (untimed) so that the next race starts on a free lease. On
        a lease someone else holds ("held") nobody wins and nobody waits for a lock: what one
        interpreter on this machine makes of 32 simultaneous requests."""
        self.kind = kind
        self.start.wait()
        self.done.wait()
        self.bench.record(
            kind, [(contender.seconds, contender.won is not None) for contender in self.contenders]
        )
        for contender in self.contenders:
            if contender.won is not None:
                contender.won()

    def close(self) -> None:
        self.kind = "stop"
        self.start.wait()
        for contender in self.contenders:
            contender.join()
            contender.store.dispose()


@dataclass(frozen=True)
class Signals:
    """What the process contenders share with this process: which race comes next
    (``STOP``: none), the barriers of :class:`Race` and one more among the contenders (every
    one has its answer, so the winner may give the lease up), and each contender's timing
    and win."""

    kind: Any
    start: threading.Barrier
    go: threading.Barrier
    answered: threading.Barrier
    done: threading.Barrier
    seconds: Any
    won: Any


def process_contender(url: str, index: int, signals: Signals) -> None:
    """One racer in a process of its own, with its own ``LeaseStore``: it waits for each race,
    times its acquisition, and gives a lease it won up (untimed) once every racer has had its
    answer, before the race ends."""
    store = contender_store(url)
    holder = f"process-{index}"
    names = list(PROCESS_RACES.values())
    signals.done.wait()  # connected
    try:
        while True:
            signals.start.wait()
            if signals.kind.value == STOP:
                return
            seconds, lease = timed_acquire(store, names[signals.kind.value], holder, signals.go)
            signals.seconds[index] = seconds
            signals.won[index] = lease is not None
            signals.answered.wait()
            if lease is not None:
                store.release(lease)
            signals.done.wait()
    finally:
        store.dispose()


class ProcessRace:
    """``CONTENDERS`` processes released by a barrier onto one lease: the same contention as
    :class:`Race`, without one interpreter lock over every contender."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        context = multiprocessing.get_context("spawn")
        self.signals = Signals(
            kind=context.Value("i", STOP, lock=False),
            start=context.Barrier(CONTENDERS + 1, timeout=BARRIER_TIMEOUT),
            go=context.Barrier(CONTENDERS, timeout=BARRIER_TIMEOUT),
            answered=context.Barrier(CONTENDERS, timeout=BARRIER_TIMEOUT),
            done=context.Barrier(CONTENDERS + 1, timeout=BARRIER_TIMEOUT),
            seconds=context.Array("d", CONTENDERS, lock=False),
            won=context.Array("b", CONTENDERS, lock=False),
        )
        url = bench.url.render_as_string(hide_password=False)
        self.processes = [
            context.Process(target=process_contender, args=(url, index, self.signals), daemon=True)
            for index in range(CONTENDERS)
        ]
        for process in self.processes:
            process.start()
        self.signals.done.wait()  # every contender has connected

    def run(self, kind: str) -> None:
        """One race of ``kind`` ("process" on a free lease, "process_held" on a held one)."""
        self.signals.kind.value = list(PROCESS_RACES).index(kind)
        self.signals.start.wait()
        self.signals.done.wait()
        self.bench.record(
            kind,
            [(self.signals.seconds[i], bool(self.signals.won[i])) for i in range(CONTENDERS)],
        )

    def close(self) -> None:
        self.signals.kind.value = STOP
        self.signals.start.wait()
        for process in self.processes:
            process.join()


def measure(url: URL, rounds: int, warmup: int, race_every: int) -> Samples:
    bench = Bench(url)
    processes = ProcessRace(bench)
    threads = Race(bench)
    races: list[tuple[Callable[[str], None], str]] = [
        *((threads.run, kind) for kind in THREAD_RACES),
        *((processes.run, kind) for kind in PROCESS_RACES),
    ]
    order = random.Random(0)
    variants = bench.variants()
    try:
        for round_number in range(1 - warmup, rounds + 1):
            if round_number == 1:
                for samples in bench.samples.values():
                    samples.clear()
            order.shuffle(variants)
            for variant in variants:
                variant()
            if round_number % race_every == 0:
                for run, kind in order.sample(races, len(races)):
                    run(kind)
        return bench.samples
    finally:
        threads.close()
        processes.close()
        bench.close()


def p99(values: list[float]) -> float:
    return percentile(values, 0.99)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def report(samples: Samples) -> bool:
    """Print the table, the targets and the breakdown; return whether every target was met."""
    median = {key: statistics.median(values) for key, values in samples.items()}
    print(f"\n{'variant':<64} {'n':>6} {'median ms':>9} {'p99 ms':>8} {'x upsert':>8}")
    for key, label in LABELS.items():
        values = samples[key]
        print(
            f"{label:<64} {len(values):>6} {ms(median[key]):>9} {ms(p99(values)):>8}"
            f" {median[key] / median['upsert']:>8.2f}"
        )
    print(f"\n{'target':<64} {'ratio':>6} {'limit':>6}")
    met = True
    for target in TARGETS:
        values = samples[target.numerator]
        top = p99(values) if target.use_p99 else median[target.numerator]
        ratio = top / median[target.denominator]
        verdict = "PASS" if ratio <= target.limit else "MISS"
        met = met and verdict == "PASS"
        print(f"{target.label:<64} {ratio:>6.2f} {target.limit:>6.2f}  {verdict}")
    print("\nwhere the time goes (medians)")
    print(
        f"  {'the lease row takeover UPDATE alone / the raw statement':<62} "
        f"{median['bare'] / median['raw']:>8.2f} x"
    )
    for label, more, less in (
        ("celery_fence.acquire() over the lease row's takeover UPDATE", "sql_win", "bare"),
        ("LeaseStore.acquire over celery_fence.acquire()", "lib_win", "sql_win"),
        ("store.guard over the unguarded transaction", "guarded", "unguarded"),
    ):
        print(f"  {label:<62} {ms(median[more] - median[less]):>8} ms")
    tenth = max(1, len(samples["lib_win"]) // 10)
    first, last = samples["lib_win"][:tenth], samples["lib_win"][-tenth:]
    print(
        f"  {'winning LeaseStore.acquire, first / last tenth of the rounds':<62} "
        f"{ms(statistics.median(first))} / {ms(statistics.median(last))} ms"
    )
    for label, key, base in (
        ("threads calling celery_fence.acquire() directly", "race_sql_lose", "sql_win"),
        ("threads with the raw one-statement acquire", "race_raw_lose", "raw"),
        ("threads on a held lease (no lock to wait for)", "race_held_lose", "lib_win"),
        ("processes on a held lease (no lock to wait for)", "race_process_held_lose", "lib_win"),
    ):
        ratio = p99(samples[key]) / median[base]
        print(f"  {CONTENDERS} {label}: losers' p99 / uncontended = {ratio:.2f}")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_database_url(parser)
    parser.add_argument("--rounds", type=int, default=2000, help="measured rounds (default 2000)")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured rounds first")
    parser.add_argument(
        "--race-every",
        type=int,
        default=20,
        help=f"run the {CONTENDERS}-contender races every N rounds (default 20)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    with scratch_database(args.database_url, "bench") as url:
        print(
            f"celery-fence protocol benchmark, {date.today()}: PostgreSQL "
            f"{server_version(url)}, Python {platform.python_version()}, "
            f"psycopg {psycopg.__version__}, SQLAlchemy {sa.__version__}, "
            f"{os.cpu_count()} cores; {args.rounds} rounds, {CONTENDERS}-contender races "
            f"every {args.race_every}",
            flush=True,
        )
        started = time.monotonic()
        samples = measure(url, args.rounds, args.warmup, args.race_every)
        print(f"measured in {time.monotonic() - started:.0f} s")
    met = report(samples)
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
