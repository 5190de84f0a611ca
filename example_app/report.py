"""What the database says happened, and the invariants the demo checks against it.

Everything here reads the database only: who won each epoch (``lease_history``), which
schedule slots were dispatched under which epoch, every rejected stale run, the manifests,
the release log and the retention plans.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from celery_fence import Dispatch, HistoryEntry, LeaseStore, Owner, StaleRun
from example_app import data
from example_app.tasks import publish_action

LIMIT = 10_000


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The database's state; every list is oldest first."""

    leases: list[Owner]
    history: dict[str, list[HistoryEntry]]
    dispatches: list[Dispatch]
    stale_runs: list[StaleRun]
    manifests: list[data.Manifest]
    releases: list[data.ReleaseRecord]
    plans: list[data.Plan]
    documents: int

    def epoch(self, lease: str, epoch: int) -> HistoryEntry | None:
        return next((h for h in self.history.get(lease, []) if h.epoch == epoch), None)

    def release(self, task_id: str) -> data.ReleaseRecord | None:
        """How the release run with ``task_id`` ended (its last attempt)."""
        return next((r for r in reversed(self.releases) if r.task_id == task_id), None)


def take_snapshot(store: LeaseStore) -> Snapshot:
    leases = store.leases()
    engine = store.engine
    with engine.connect() as conn:
        documents = data.document_count(conn)
    return Snapshot(
        leases=leases,
        history={o.name: store.history(o.name, limit=LIMIT)[::-1] for o in leases},
        dispatches=[d for o in leases for d in store.dispatches(o.name, limit=LIMIT)[::-1]],
        stale_runs=store.stale_runs(limit=LIMIT)[::-1],
        manifests=data.manifests(engine),
        releases=data.releases(engine),
        plans=data.plans(engine),
        documents=documents,
    )


# -- rendering -------------------------------------------------------------------------------


def clock(moment: datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%H:%M:%S.%f")[:-3]


def render(snapshot: Snapshot) -> list[str]:
    """The report's sections, as lines of text."""
    lines = ["Who won each epoch"]
    for name, entries in snapshot.history.items():
        lines.append(f"  {name} (environment {entries[0].environment if entries else '?'})")
        width = max((len(h.holder) for h in entries), default=0)
        lines += [
            f"    epoch {h.epoch:<3} {h.holder:<{width}} from {clock(h.acquired_at)} "
            f"to {clock(h.ended_at)} {h.end_reason or 'holding'}"
            + (f"  [{h.purpose}]" if h.purpose else "")
            for h in entries
        ]
    if not snapshot.history:
        lines.append("  (none)")
    lines.append("Current manifest per environment")
    lines += [
        f"  {m.environment:<11} {m.release_id:<6} build {m.build:<4} commit {m.commit} "
        f"epoch {m.epoch}{' (rollback)' if m.rollback else ''}, published {clock(m.published_at)}"
        for m in snapshot.manifests
    ] or ["  (none)"]
    lines.append("Release attempts")
    lines += [
        f"  {r.environment:<11} {r.release_id:<6} build {r.build:<4} epoch {r.epoch:<3} "
        f"{r.outcome:<9} {r.detail.splitlines()[0] if r.detail else ''}"
        for r in snapshot.releases
    ] or ["  (none)"]
    lines.append("Rejected stale runs per environment")
    by_environment: dict[str, list[StaleRun]] = defaultdict(list)
    for run in snapshot.stale_runs:
        by_environment[run.environment].append(run)
    for environment, runs in sorted(by_environment.items()):
        lines.append(f"  {environment}: {len(runs)}")
        lines += [
            f"    {clock(s.recorded_at)} {s.lease_name} epoch {s.stale_epoch} "
            f"({s.stale_holder}) {s.action!r}: {s.reason}"
            + (f", now epoch {s.current_epoch} ({s.current_holder})" if s.current_epoch else "")
            + ("" if s.enforced else " [shadow]")
            for s in runs
        ]
    if not by_environment:
        lines.append("  (none)")
    lines.append("Dispatched schedule slots")
    lines += [
        f"  {schedule} epoch {epoch} ({holder}): {counted(len(slots), 'slot')}, "
        f"{clock(slots[0].slot)} to {clock(slots[-1].slot)}"
        for (schedule, epoch, holder), slots in _by_epoch(snapshot.dispatches).items()
    ] or ["  (none)"]
    lines.append("Retention plans")
    plans = Counter((p.scheduled_by, p.schedule_epoch) for p in snapshot.plans)
    lines += [
        f"  {f'sent by {schedule} epoch {epoch}' if schedule else 'sent by hand'}: "
        f"{counted(count, 'plan')}"
        for (schedule, epoch), count in plans.items()
    ]
    due = snapshot.plans[-1].document_ids if snapshot.plans else []
    lines.append(
        f"  {counted(len(snapshot.plans), 'plan')}; the last lists {len(due)} of "
        f"{snapshot.documents} documents as due; documents are never deleted"
    )
    return lines


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless the count is one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _by_epoch(dispatches: Iterable[Dispatch]) -> dict[tuple[str, int, str], list[Dispatch]]:
    groups: dict[tuple[str, int, str], list[Dispatch]] = defaultdict(list)
    for d in dispatches:
        groups[(d.schedule, d.epoch, d.holder)].append(d)
    return dict(groups)


# -- invariants ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    ok: bool
    text: str

    def line(self) -> str:
        return f"  [{'ok' if self.ok else 'FAILED'}] {self.text}"


def slots_dispatched_once(snapshot: Snapshot) -> Check:
    """Each slot appears once, was dispatched by the holder of the epoch it names, and
    before that epoch ended."""
    problems = [
        f"slot {clock(slot)} of {entry} dispatched {count} times"
        for (schedule, entry, slot), count in Counter(
            (d.schedule, d.entry, d.slot) for d in snapshot.dispatches
        ).items()
        if count > 1
    ]
    for d in snapshot.dispatches:
        won = snapshot.epoch(d.schedule, d.epoch)
        if won is None or won.holder != d.holder:
            problems.append(f"slot {clock(d.slot)} dispatched by {d.holder}, not epoch {d.epoch}'s")
        elif won.ended_at is not None and d.dispatched_at > won.ended_at:
            problems.append(f"slot {clock(d.slot)} dispatched after epoch {d.epoch} ended")
    epochs = sorted({d.epoch for d in snapshot.dispatches})
    return _check(
        problems or ([] if snapshot.dispatches else ["no slot was dispatched"]),
        f"each schedule slot dispatched at most once, by its epoch's holder while it held "
        f"({counted(len(snapshot.dispatches), 'slot')} under epochs {epochs})",
    )


def _while_held(snapshot: Snapshot, lease: str, epoch: int, at: datetime) -> bool:
    """Whether ``at`` (a time the database's clock gave a write) falls between the winning of
    ``lease``'s ``epoch`` and its end: a fenced write commits only while its epoch holds, and
    is stamped before its check."""
    won = snapshot.epoch(lease, epoch)
    return (
        won is not None and won.acquired_at <= at and (won.ended_at is None or at <= won.ended_at)
    )


def one_plan_per_slot(snapshot: Snapshot) -> Check:
    """Per scheduler epoch, no more plans from beat than slots it dispatched; each plan written
    by the holder of the planner lease's epoch it names, while that epoch held."""
    slots: Counter[tuple[str | None, int | None]] = Counter(
        (d.schedule, d.epoch) for d in snapshot.dispatches
    )
    scheduled = [p for p in snapshot.plans if p.scheduled_by is not None]
    plans = Counter((p.scheduled_by, p.schedule_epoch) for p in scheduled)
    problems = [
        f"{counted(count, 'plan')} for {counted(slots[key], 'slot')} sent by {key[0]} "
        f"epoch {key[1]}"
        for key, count in plans.items()
        if count > slots[key]
    ]
    problems += [
        f"plan {p.id} written by {p.holder}, not by {p.lease_name} epoch {p.epoch}'s holder"
        for p in scheduled
        if (won := snapshot.epoch(p.lease_name, p.epoch)) is None or won.holder != p.holder
    ]
    problems += [
        f"plan {p.id} written at {clock(p.planned_at)}, while {p.lease_name} epoch {p.epoch} "
        "did not hold"
        for p in scheduled
        if not _while_held(snapshot, p.lease_name, p.epoch, p.planned_at)
    ]
    return _check(
        problems or ([] if scheduled else ["no retention plan was written"]),
        f"at most one retention plan per dispatched slot ({counted(len(scheduled), 'plan')} for "
        f"{counted(len(snapshot.dispatches), 'slot')})",
    )


def nothing_deleted(snapshot: Snapshot, seeded: int) -> Check:
    return _check(
        [] if snapshot.documents == seeded else [f"{snapshot.documents} documents left"],
        f"planning deleted nothing ({seeded} documents seeded, {snapshot.documents} remain)",
    )


def failover(snapshot: Snapshot, schedule: str, paused_epoch: int) -> Check:
    """A newer epoch than the paused leader's was won by another instance."""
    paused = snapshot.epoch(schedule, paused_epoch)
    later = [h for h in snapshot.history.get(schedule, []) if h.epoch > paused_epoch]
    ok = paused is not None and any(h.holder != paused.holder for h in later)
    return Check(
        ok,
        f"beat failover: while epoch {paused_epoch}'s leader was paused, "
        + (
            f"{later[0].holder} took over at epoch {later[0].epoch}"
            if later
            else "nobody took over"
        ),
    )


def current_manifest(snapshot: Snapshot, environment: str, winner_task_id: str) -> Check:
    """The environment has one manifest, and it is what the winning release published while
    its epoch held."""
    winner = snapshot.release(winner_task_id)
    found = [m for m in snapshot.manifests if m.environment == environment]
    ok = (
        len(found) == 1
        and winner is not None
        and winner.outcome == "published"
        and (found[0].release_id, found[0].build, found[0].epoch)
        == (winner.release_id, winner.build, winner.epoch)
        and _while_held(snapshot, f"release:{environment}", found[0].epoch, found[0].published_at)
    )
    now = (
        f"{found[0].release_id} build {found[0].build} epoch {found[0].epoch}" if found else "none"
    )
    wanted = f"{winner.release_id} build {winner.build} epoch {winner.epoch}" if winner else "?"
    return Check(
        ok, f"{environment}: one current manifest, the winning release's ({now}; winner {wanted})"
    )


def publish_rejected(snapshot: Snapshot, task_id: str) -> Check:
    """The run's publish was rejected and no manifest carries its epoch."""
    record = snapshot.release(task_id)
    ok = record is not None and record.outcome == "rejected"
    if record is not None:
        ok = ok and not any(
            m.environment == record.environment and m.epoch == record.epoch
            for m in snapshot.manifests
        )
    where = (
        f"{record.release_id} at epoch {record.epoch}: {record.outcome}" if record else "no record"
    )
    return Check(ok, f"the expired holder's publish was rejected ({where})")


def rejections_recorded(snapshot: Snapshot, lost: Iterable[tuple[str, int]] = ()) -> Check:
    """Every rejected publish in the release log, and every ``(lease, epoch)`` in ``lost``,
    has a row in celery_fence.stale_runs."""
    wanted = [
        (
            f"release:{r.environment}",
            r.epoch,
            r.holder,
            publish_action(r.release_id, r.build),
        )
        for r in snapshot.releases
        if r.outcome == "rejected"
    ]
    stale = snapshot.stale_runs
    missing = [
        f"{lease} epoch {epoch} {action!r}"
        for lease, epoch, holder, action in wanted
        if not any(
            (s.lease_name, s.stale_epoch, s.stale_holder, s.action)
            == (lease, epoch, holder, action)
            for s in stale
        )
    ]
    missing += [
        f"{lease} epoch {epoch}"
        for lease, epoch in lost
        if not any((s.lease_name, s.stale_epoch) == (lease, epoch) for s in stale)
    ]
    return _check(
        missing,
        f"every rejected stale run is recorded ({len(stale)} in celery_fence.stale_runs)",
    )


def _check(problems: list[str], text: str) -> Check:
    return Check(not problems, text if not problems else f"{text}: {'; '.join(problems)}")
