"""Concurrent acquisition: independent connections released together by a barrier.

Every round, N contenders (each a ``LeaseStore`` on an engine with one connection of its own, so
that the race is between PostgreSQL backends, not inside one pool) call ``acquire`` at the same
instant on a lease that is expired, released or does not exist yet. Exactly one wins, the epoch
rises by exactly one, and every loser is told the committed winner, never the holder it replaced
nor "nobody".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from celery_fence import Acquisition, Lease, LeaseLostError, LeaseStore
from celery_fence.store import engine_from_url, proof

TTL = 30.0
BARRIER_TIMEOUT = 30.0


class Contenders:
    """N stores, each on one warmed-up connection of its own, and the threads that drive them."""

    def __init__(self, database_url: str, count: int) -> None:
        self.engines = [
            engine_from_url(database_url, pool_size=1, max_overflow=0) for _ in range(count)
        ]
        self.stores = [LeaseStore(engine) for engine in self.engines]
        for engine in self.engines:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        self.barrier = threading.Barrier(count)
        self.pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="contender")

    def race(self, name: str) -> list[Acquisition]:
        """All contenders acquire ``name`` at once; the answers in contender order."""

        def contend(index: int) -> Acquisition:
            self.barrier.wait(BARRIER_TIMEOUT)
            return self.stores[index].acquire(
                name, holder=f"contender-{index}", ttl=TTL, environment="race", purpose="race"
            )

        futures = [self.pool.submit(contend, index) for index in range(len(self.stores))]
        return [future.result(timeout=BARRIER_TIMEOUT * 2) for future in futures]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for engine in self.engines:
            engine.dispose()


@pytest.fixture
def contenders(request: pytest.FixtureRequest, database_url: str) -> Iterator[Contenders]:
    group = Contenders(database_url, request.param)
    yield group
    group.close()


def history_epochs(engine: Engine, name: str) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT epoch FROM celery_fence.history(:n) ORDER BY epoch"),
            {"n": name},
        )
        return list(rows.scalars())


def check_round(
    store: LeaseStore, name: str, answers: list[Acquisition], previous_epoch: int
) -> Acquisition:
    """Exactly one winner at ``previous_epoch + 1``; every loser sees that winner committed."""
    winners = [answer for answer in answers if answer.acquired]
    assert len(winners) == 1, [answer.outcome for answer in answers]
    winner = winners[0]
    assert winner.outcome == "acquired"
    assert winner.lease is not None
    assert winner.lease.epoch == previous_epoch + 1
    assert winner.owner is not None
    assert (winner.owner.holder, winner.owner.epoch) == (winner.lease.holder, winner.lease.epoch)
    assert winner.owner.acquired_at == winner.lease.acquired_at
    assert winner.owner.expires_at == winner.lease.expires_at
    current = store.owner(name)
    assert current == winner.owner
    for loser in answers:
        if loser is winner:
            continue
        assert loser.outcome == "held"
        assert loser.lease is None
        # The whole safe metadata, not only the epoch: the committed winner's, as owner() reads it.
        assert loser.owner == winner.owner
    assert history_epochs(store.engine, name)[-1] == winner.lease.epoch
    return winner


SIZES = [
    pytest.param(2, 150, id="2x150"),
    pytest.param(8, 40, id="8x40"),
    pytest.param(32, 12, id="32x12"),
]


@pytest.mark.parametrize(("contenders", "rounds"), SIZES, indirect=["contenders"])
@pytest.mark.parametrize("freed_by", ["expired", "released"])
def test_one_winner_per_round_on_a_freed_lease(
    store: LeaseStore,
    contenders: Contenders,
    rounds: int,
    freed_by: str,
    expire_lease: Callable[[str], None],
) -> None:
    """Each round frees the lease the previous one granted: its row is aged past its expiry
    (the database clock then says expired), or its holder releases it."""
    name = f"race:{freed_by}"
    previous = store.acquire(name, holder="seed", ttl=TTL, environment="race").lease
    for _ in range(rounds):
        assert previous is not None
        if freed_by == "expired":
            expire_lease(name)
        else:
            store.release(previous)
        previous = check_round(store, name, contenders.race(name), previous.epoch).lease
    assert history_epochs(store.engine, name) == list(range(1, rounds + 2))


@pytest.mark.parametrize(("contenders", "rounds"), SIZES, indirect=["contenders"])
def test_one_winner_per_round_on_a_new_lease(
    store: LeaseStore, contenders: Contenders, rounds: int
) -> None:
    for round_number in range(rounds):
        name = f"race:new:{round_number}"
        winner = check_round(store, name, contenders.race(name), previous_epoch=0)
        assert history_epochs(store.engine, name) == [1]
        assert winner.owner is not None
        assert winner.owner.environment == "race"


def resume(store: LeaseStore, lease: Lease) -> Acquisition | LeaseLostError:
    """A continuation of ``lease``'s run taking it back, or what refused it."""
    try:
        return store.rejoin(
            lease.name,
            epoch=lease.epoch,
            holder=lease.holder,
            mode="resume",
            proof=proof(lease, "resume"),
            ttl=TTL,
            action="resume",
        )
    except LeaseLostError as exc:
        return exc


@pytest.mark.parametrize("contenders", [4], indirect=True)
def test_a_resuming_continuation_races_acquirers_without_deadlock(
    store: LeaseStore, contenders: Contenders, expire_lease: Callable[[str], None]
) -> None:
    """A continuation taking back its expired lease (``rejoin`` in mode ``resume``, which locks
    the row and then acquires) against plain acquirers of the same lease: every round ends with
    exactly one new epoch, and nobody waits on anybody in a cycle."""
    name = "race:resume"
    previous = store.acquire(name, holder="first", ttl=TTL, environment="race").lease
    resumed = 0
    for _ in range(40):
        assert previous is not None
        expire_lease(name)

        def contend(index: int, lease: Lease) -> Acquisition | LeaseLostError:
            contender = contenders.stores[index]
            contenders.barrier.wait(BARRIER_TIMEOUT)
            if index == 0:
                return resume(contender, lease)
            return contender.acquire(name, holder=f"contender-{index}", ttl=TTL)

        futures = [contenders.pool.submit(contend, index, previous) for index in range(4)]
        answers = [future.result(timeout=BARRIER_TIMEOUT * 2) for future in futures]
        winners = [
            answer.lease
            for answer in answers
            if isinstance(answer, Acquisition) and answer.lease is not None
        ]
        assert len(winners) == 1, answers
        assert winners[0].epoch == previous.epoch + 1
        continuation = answers[0]
        if isinstance(continuation, LeaseLostError):
            assert continuation.reason == "superseded"
        else:
            resumed += continuation.outcome == "resumed"
        previous = winners[0]
    assert history_epochs(store.engine, name) == list(range(1, 42))
    assert resumed, "the continuation never won a round"
