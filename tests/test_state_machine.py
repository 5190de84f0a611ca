"""A Hypothesis state machine: three holders on one lease against a small model of the protocol.

The rules drive a real ``LeaseStore`` on a real database (a database for this test, a new lease
name for each example) while freezegun moves the injected clock and the holders' monotonic
clocks together. The model is the protocol written out plainly: who holds which epoch, until
when, released or paused. After every step the database must agree with it.

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
    Lease,
    LeaseError,
    LeaseLostError,
    LeasePausedError,
    LeaseStore,
    StaleEpochError,
)

START = datetime(2030, 1, 1, tzinfo=timezone.utc)
HOLDERS = ("beat@a", "beat@b", "beat@c")
SAFETY_MARGIN = 0.5
DEFAULT_HOLD = 86_400.0
ENVIRONMENT = "model"
_names = itertools.count()


@dataclass
class Grant:
    """A lease one holder was given, and until when (model time) it trusts it."""

    lease: Lease
    trusted_until: float


@dataclass
class Model:
    """The lease as the protocol says it should stand, times in seconds since START."""

    now: float = 0.0
    exists: bool = False
    epoch: int = 0
    holder: str = ""
    expires: float = 0.0
    hold_until: float = 0.0
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

    def grant(self, lease: Lease) -> Grant:
        return Grant(lease, self.now + (self.expires - self.now) * (1 - SAFETY_MARGIN))


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self, engine: Engine, clock: Callable[[], datetime]) -> None:
        super().__init__()
        self.engine = engine
        self.clock = clock
        self.store = LeaseStore(engine, clock=clock, safety_margin=SAFETY_MARGIN)
        self.name = f"model:{next(_names)}"
        self.model = Model()
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
        model.exists, model.released = True, False
        model.epoch += 1
        model.holder = holder
        model.expires = model.now + ttl
        model.hold_until = model.now + (DEFAULT_HOLD if max_hold is None else max_hold)
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
        model.grants[holder] = model.grant(renewed)

    @precondition(lambda self: self.model.grants)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        model = self.model
        grant = model.grants[data.draw(st.sampled_from(sorted(model.grants)))]
        current = grant.lease.epoch == model.epoch
        if current and not model.released and model.expires > model.now:
            self.store.release(grant.lease)
            model.released = True
            model.expires = min(model.expires, model.now)
        elif current and model.released:
            self.store.release(grant.lease)  # releasing twice is harmless
        else:
            with pytest.raises(LeaseLostError) as caught:
                self.store.release(grant.lease)
            assert caught.value.reason == model.stale_reason(grant)
            model.refused(caught.value.reason, grant, "release")

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
            model.expires = model.hold_until = model.now
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
    def at_most_one_holder_is_trusted(self) -> None:
        """Of all holders, at most one both trusts its lease and passes the database's fence."""
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
        assert len(trusted) <= 1
        expected = [
            holder
            for holder, grant in self.model.grants.items()
            if self.model.stale_reason(grant) is None and self.model.now < grant.trusted_until
        ]
        assert trusted == expected


def test_the_protocol_follows_its_model(engine: Engine, clock: Callable[[], datetime]) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE model_writes (name text, holder text, epoch bigint)")
    run_state_machine_as_test(
        lambda: LeaseMachine(engine, clock),  # type: ignore[arg-type]  # any factory will do
        settings=settings(max_examples=100, stateful_step_count=30, deadline=None),
    )
