"""A Hypothesis state machine: three holders on one lease, and the continuations they publish,
against a small model of the protocol.

The rules drive a real ``LeaseStore`` on a real database (a database for this test, a new lease
name for each example) while freezegun moves the injected clock and the holders' monotonic
clocks together. The model is the protocol written out plainly: who holds which epoch, until
when, released or paused, shared with which deliveries of which continuations, and which of
them left it, finished or not. After every step the database must agree with it.

Times are kept to multiples of a quarter second and the safety margin to one half, so that the
model's arithmetic and the library's are both exact and agree at every boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from freezegun import freeze_time
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.engine import Engine

from celery_fence import (
    Acquisition,
    Lease,
    LeaseError,
    LeaseLostError,
    LeasePausedError,
    LeaseStore,
    StaleEpochError,
)
from celery_fence.store import proof

START = datetime(2030, 1, 1, tzinfo=timezone.utc)
HOLDERS = ("beat@a", "beat@b", "beat@c")
#: The continuations' messages, as the deliveries of each begin their holders' names.
DELIVERIES = ("child[1]@", "child[2]@")
SAFETY_MARGIN = 0.5
DEFAULT_HOLD = 86_400.0
ENVIRONMENT = "model"
_names = itertools.count()


@dataclass
class Grant:
    """A lease one holder (or one delivery of a continuation, sharing it) was given, and until
    when (model time) it trusts it."""

    lease: Lease
    trusted_until: float
    #: For a delivery's share: when it joined (model time).
    joined: float | None = None


@dataclass
class Join:
    """A delivery's join of an epoch, as ``celery_fence.joins`` keeps it."""

    joined: float
    left: bool = False
    finished: bool = False


@dataclass
class Model:
    """The lease as the protocol says it should stand, times in seconds since START."""

    now: float = 0.0
    exists: bool = False
    epoch: int = 0
    holder: str = ""
    expires: float = 0.0
    acquired: float = 0.0
    hold_until: float = 0.0
    #: The lease's sharers: its holder, and each delivery that joined it.
    sharers: int = 1
    joins: dict[tuple[int, str], Join] = field(default_factory=dict)
    released: bool = False
    paused: bool = False
    #: Whether a renewal of the epoch was refused (its holder told it lost the lease) since the
    #: lease was paused.
    refused_while_paused: bool = False
    grants: dict[str, Grant] = field(default_factory=dict)
    stale_runs: int = 0
    writes: int = 0

    def free(self) -> bool:
        return not self.exists or self.released or self.expires <= self.now

    def state(self) -> str:
        if self.paused:
            return "paused"
        if self.released:
            return "released"
        return "expired" if self.expires <= self.now else "held"

    def stale_reason(self, grant: Grant) -> str | None:
        """Why ``grant`` no longer holds the lease in the database; ``None`` while it does."""
        if grant.lease.epoch < self.epoch:
            return "superseded"
        state = self.state()
        return None if state == "held" else state

    def refused(self, reason: str, grant: Grant, action: str) -> None:
        """A stale ``action`` (renew, release, write) of ``grant`` was recorded for ``reason``."""
        self.stale_runs += 1
        if reason == "paused" and action == "renew" and grant.lease.epoch == self.epoch:
            self.refused_while_paused = True

    def grant(self, lease: Lease, joined: float | None = None) -> Grant:
        return Grant(lease, self.now + (self.expires - self.now) * (1 - SAFETY_MARGIN), joined)

    def held_at(self, grant: Grant) -> bool:
        """Whether ``grant``'s epoch is the lease's, neither released nor expired (paused or
        not): what a release can end."""
        return grant.lease.epoch == self.epoch and not self.released and self.expires > self.now

    def taken(self, holder: str, ttl: float, max_hold: float | None) -> None:
        """A winning acquisition: the next epoch, held by ``holder`` alone."""
        self.exists, self.released = True, False
        self.epoch += 1
        self.holder = holder
        self.sharers = 1
        self.expires = self.now + ttl
        self.acquired = self.now
        self.hold_until = self.now + (DEFAULT_HOLD if max_hold is None else max_hold)

    def left(self) -> str:
        """One sharer leaves the held lease: the last one releases it."""
        if self.sharers > 1:
            self.sharers -= 1
            return "left"
        self.sharers = 0
        self.released = True
        self.expires = min(self.expires, self.now)
        return "released"


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self, store: LeaseStore, clock: Callable[[], datetime]) -> None:
        super().__init__()
        self.engine = store.engine
        self.clock = clock
        self.store = store
        self.name = f"model:{next(_names)}"
        self.model = Model()
        self.joined = itertools.count()
        self.highest_epoch = 0
        self.freezer = freeze_time(START)
        self.frozen = self.freezer.start()

    def teardown(self) -> None:
        self.freezer.stop()

    # -- rules ------------------------------------------------------------------------------

    @rule(
        holder=st.sampled_from(HOLDERS),
        ttl=st.sampled_from([2.0, 5.0, 10.0]),
        hold_factor=st.sampled_from([None, 1, 2, 3]),
    )
    def acquire(self, holder: str, ttl: float, hold_factor: int | None) -> None:
        model = self.model
        max_hold = None if hold_factor is None else ttl * hold_factor
        if model.paused:
            with pytest.raises(LeasePausedError):
                self.store.acquire(
                    self.name, holder=holder, ttl=ttl, environment=ENVIRONMENT, max_hold=max_hold
                )
            return
        got = self.store.acquire(
            self.name, holder=holder, ttl=ttl, environment=ENVIRONMENT, max_hold=max_hold
        )
        if not model.free():
            assert (got.outcome, got.lease) == ("held", None)
            assert got.owner is not None
            assert (got.owner.epoch, got.owner.holder) == (model.epoch, model.holder)
            return
        assert got.outcome == "acquired"
        assert got.lease is not None
        model.taken(holder, ttl, max_hold)
        assert got.lease.epoch == model.epoch
        assert got.lease.expires_at == START + timedelta(seconds=model.expires)
        model.grants[holder] = model.grant(got.lease)

    @precondition(lambda self: self.model.grants)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        model = self.model
        holder = data.draw(st.sampled_from(sorted(model.grants)))
        grant = model.grants[holder]
        reason = model.stale_reason(grant)
        if reason is not None:
            with pytest.raises(LeaseLostError) as caught:
                self.store.renew(grant.lease)
            assert caught.value.reason == reason
            model.refused(reason, grant, "renew")
            return
        renewed = self.store.renew(grant.lease)
        model.expires = max(model.expires, min(model.now + grant.lease.ttl, model.hold_until))
        assert renewed.epoch == grant.lease.epoch
        assert renewed.expires_at == START + timedelta(seconds=model.expires)
        assert (renewed.sharer, renewed.joined_at) == (grant.lease.sharer, grant.lease.joined_at)
        model.grants[holder] = model.grant(renewed, grant.joined)

    @precondition(lambda self: self.model.grants)
    @rule(data=st.data(), finished=st.booleans())
    def release(self, data: st.DataObject, finished: bool) -> None:
        """A holder's release (each one a sharer leaving), or a delivery's leaving its share,
        finished or not."""
        model = self.model
        grant = model.grants[data.draw(st.sampled_from(sorted(model.grants)))]
        sharer = grant.lease.sharer
        join = None if sharer is None else model.joins[(grant.lease.epoch, sharer)]
        if join is not None and (
            (join.left and join.joined == grant.joined and grant.lease.epoch == model.epoch)
            or (model.held_at(grant) and join.joined != grant.joined)
        ):
            # Left already, or its join was taken by a redelivery: nothing more.
            assert self.store.release(grant.lease, finished=finished) == "left"
        elif model.held_at(grant):
            outcome = self.store.release(grant.lease, finished=finished)
            if join is not None:
                join.left, join.finished = True, finished
            # A share left unfinished is kept for the redelivery of its message.
            assert outcome == ("left" if join is not None and not finished else model.left())
        elif grant.lease.epoch == model.epoch and model.released:
            # Releasing twice is harmless.
            assert self.store.release(grant.lease, finished=finished) == "released"
        else:
            with pytest.raises(LeaseLostError) as caught:
                self.store.release(grant.lease, finished=finished)
            assert caught.value.reason == model.stale_reason(grant)
            model.refused(caught.value.reason, grant, "release")

    @precondition(lambda self: any(g.lease.sharer is None for g in self.model.grants.values()))
    @rule(data=st.data(), delivery=st.sampled_from(DELIVERIES), ttl=st.sampled_from([2.0, 5.0]))
    def continuation(self, data: st.DataObject, delivery: str, ttl: float) -> None:
        """A delivery of a continuation published under a holder's epoch takes the lease up:
        joins it while held, takes it over once released or expired, waits for (``held``,
        ``shared``) or is dropped after (``done``) an earlier delivery of its own message."""
        model = self.model
        publishers = sorted(k for k, g in model.grants.items() if g.lease.sharer is None)
        grant = model.grants[data.draw(st.sampled_from(publishers))]
        publisher, epoch = grant.lease, grant.lease.epoch
        successor = f"{delivery}host"

        def got() -> Acquisition:
            return self.store.rejoin(
                self.name,
                epoch=epoch,
                holder=publisher.holder,
                mode="resume",
                proof=proof(publisher, "resume"),
                ttl=ttl,
                action="model continuation",
                successor=successor,
                delivery_prefix=delivery,
            )

        reason = model.stale_reason(grant)
        free = reason in ("released", "expired")
        own = reason == "superseded" and not model.released and model.holder.startswith(delivery)
        join = model.joins.get((epoch, delivery))
        expected = None
        if not own and join is not None and join.finished:
            expected = "done"
        elif not own and join is not None and not join.left and reason is None:
            expected = "shared"
        elif own and (model.paused or model.expires > model.now):
            expected = "paused" if model.paused else "held"
        elif reason is not None and not free and not own:
            with pytest.raises(LeaseLostError) as caught:
                got()
            assert caught.value.reason == reason
            model.refused(reason, grant, "rejoin")
            return
        if expected is not None:
            answer = got()
            assert (answer.outcome, answer.lease) == (expected, None)
            return
        answer = got()
        assert answer.lease is not None
        if free or own:
            # A new ownership: the next epoch, a new hold window as long as the last one's.
            model.taken(successor, ttl, max(ttl, model.hold_until - model.acquired))
            assert (answer.outcome, answer.lease.epoch) == ("resumed", model.epoch)
            model.grants[successor] = model.grant(answer.lease)
            return
        if join is None:
            model.sharers += 1  # a join left unfinished kept its share for this one
        model.expires = max(model.expires, min(model.now + ttl, model.hold_until))
        model.joins[(epoch, delivery)] = Join(model.now)
        assert (answer.outcome, answer.lease.epoch, answer.lease.sharer) == (
            "joined",
            epoch,
            delivery,
        )
        model.grants[f"{delivery}{next(self.joined)}"] = model.grant(answer.lease, model.now)

    @precondition(lambda self: self.model.grants)
    @rule(data=st.data())
    def guarded_write(self, data: st.DataObject) -> None:
        model = self.model
        grant = model.grants[data.draw(st.sampled_from(sorted(model.grants)))]
        trusted = model.now < grant.trusted_until
        # Past the holder's own deadline the write is rejected before its body runs.
        expected = model.stale_reason(grant) if trusted else "expired"
        ran: list[Lease] = []
        if expected is None:
            self.write(grant.lease, ran)
            model.writes += 1
        else:
            with pytest.raises(StaleEpochError) as caught:
                self.write(grant.lease, ran)
            assert caught.value.reason == expected
            model.refused(expected, grant, "write")
        assert bool(ran) is trusted

    def write(self, lease: Lease, ran: list[Lease]) -> None:
        """Insert one row under the guard; ``ran`` learns whether the body ran."""
        with self.engine.begin() as conn, self.store.guard(lease, conn, action="model write"):
            ran.append(lease)
            conn.execute(
                sa.text("INSERT INTO model_writes VALUES (:name, :holder, :epoch)"),
                {"name": self.name, "holder": lease.holder, "epoch": lease.epoch},
            )

    @rule(seconds=st.sampled_from([0.25, 0.5, 1.0, 2.5, 4.0, 8.0, 16.0]))
    def time_passes(self, seconds: float) -> None:
        self.frozen.tick(seconds)
        self.model.now += seconds

    @rule(by=st.sampled_from(["ops", "oncall"]))
    def pause(self, by: str) -> None:
        model = self.model
        owner = self.store.pause(self.name, reason="model pause", by=by, environment=ENVIRONMENT)
        if not model.exists:
            model.exists, model.released = True, True
            model.expires = model.hold_until = model.acquired = model.now
        model.paused = True
        assert (owner.paused, owner.paused_by, owner.epoch) == (True, by, model.epoch)

    @rule()
    def resume(self) -> None:
        if not self.model.exists:
            with pytest.raises(LeaseError):
                self.store.resume(self.name)
            return
        assert not self.store.resume(self.name).paused
        model = self.model
        if model.paused and model.refused_while_paused:
            # The epoch the pause found ends with it, since its holder's renewal was refused:
            # told it lost the lease, the holder stopped renewing it.
            model.expires = min(model.expires, model.now)
        model.paused = model.refused_while_paused = False

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def the_database_agrees_with_the_model(self) -> None:
        model = self.model
        owner = self.store.owner(self.name)
        if not model.exists:
            assert owner is None
            return
        assert owner is not None
        assert (owner.epoch, owner.holder, owner.paused, owner.state) == (
            model.epoch,
            model.holder,
            model.paused,
            model.state(),
        )
        assert owner.expires_at == START + timedelta(seconds=model.expires)
        # The epoch never decreases, and only winning acquisitions raise it: one history row each.
        assert owner.epoch >= self.highest_epoch
        self.highest_epoch = owner.epoch
        history = self.store.history(self.name, limit=10_000)
        assert [entry.epoch for entry in history] == list(range(model.epoch, 0, -1))
        with self.engine.connect() as conn:
            sharers = conn.execute(
                sa.text("SELECT sharers FROM celery_fence.leases WHERE name = :n"),
                {"n": self.name},
            ).scalar_one()
            joins = conn.execute(
                sa.text(
                    "SELECT epoch, delivery, joined_at, left_at IS NOT NULL, finished"
                    " FROM celery_fence.joins WHERE name = :n"
                ),
                {"n": self.name},
            ).all()
        assert sharers == model.sharers
        assert {
            (epoch, delivery): (joined, left, finished)
            for epoch, delivery, joined, left, finished in joins
        } == {
            key: (START + timedelta(seconds=join.joined), join.left, join.finished)
            for key, join in model.joins.items()
        }

    @invariant()
    def rejections_are_recorded_and_writes_land_only_when_held(self) -> None:
        with self.engine.connect() as conn:
            stale, writes, foreign = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM celery_fence.stale_runs WHERE lease_name = :n),"
                    " count(*), count(*) FILTER (WHERE h.holder IS DISTINCT FROM w.holder)"
                    " FROM model_writes w LEFT JOIN celery_fence.history(:n, :now) h"
                    " ON h.epoch = w.epoch WHERE w.name = :n"
                ),
                {"n": self.name, "now": self.clock()},
            ).one()
        # Every committed write was made under an epoch by that epoch's winner.
        assert (stale, writes, foreign) == (self.model.stale_runs, self.model.writes, 0)

    @invariant()
    def at_most_one_epoch_is_trusted(self) -> None:
        """Of all holders, and the deliveries sharing their leases, those that both trust their
        lease and pass the database's fence hold one epoch at most."""
        trusted = []
        with self.engine.connect() as conn:
            for holder, grant in self.model.grants.items():
                reason = conn.execute(
                    sa.text("SELECT reason FROM celery_fence.check_fence(:n, :e, :t, :now)"),
                    {
                        "n": self.name,
                        "e": grant.lease.epoch,
                        "t": grant.lease.token,
                        "now": self.clock(),
                    },
                ).scalar_one()
                assert reason == self.model.stale_reason(grant)
                if reason is None and grant.lease.trusted:
                    trusted.append(holder)
            conn.rollback()
        assert len({self.model.grants[holder].lease.epoch for holder in trusted}) <= 1
        expected = [
            holder
            for holder, grant in self.model.grants.items()
            if self.model.stale_reason(grant) is None and self.model.now < grant.trusted_until
        ]
        assert trusted == expected


def test_the_protocol_follows_its_model(engine: Engine, clock: Callable[[], datetime]) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE model_writes (name text, holder text, epoch bigint)")
    # One store for every example (each on a lease of its own), on the connections it keeps.
    store = LeaseStore(engine, clock=clock, safety_margin=SAFETY_MARGIN)
    try:
        run_state_machine_as_test(
            lambda: LeaseMachine(store, clock),  # type: ignore[arg-type]  # any factory will do
            settings=settings(max_examples=200, stateful_step_count=40, deadline=None),
        )
    finally:
        store.dispose()
