-- celery-fence schema: the tables, types and indexes as the migrations leave them.
-- A test replays sql/migrations on an empty database and compares the result with this file.

CREATE SCHEMA celery_fence;

CREATE TABLE celery_fence.migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE celery_fence.leases (
    name          text        PRIMARY KEY,
    environment   text        NOT NULL,
    holder        text        NOT NULL,
    purpose       text        NOT NULL DEFAULT '',
    epoch         bigint      NOT NULL CHECK (epoch >= 0),
    token         uuid        NOT NULL,
    acquired_at   timestamptz NOT NULL,
    renewed_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    hold_until    timestamptz NOT NULL,
    released_at   timestamptz,
    sharers       integer     NOT NULL DEFAULT 1 CHECK (sharers >= 0),
    paused        boolean     NOT NULL DEFAULT false,
    paused_reason text,
    paused_by     text,
    paused_at     timestamptz,
    CONSTRAINT leases_expiry_within_hold CHECK (expires_at <= hold_until)
) WITH (fillfactor = 70);

-- Epochs that ended, one row each, written when the epoch ends; the epoch a lease row still
-- carries is in leases (celery_fence.history() shows both).
CREATE TABLE celery_fence.lease_history (
    name         text        NOT NULL,
    epoch        bigint      NOT NULL,
    environment  text        NOT NULL,
    holder       text        NOT NULL,
    purpose      text        NOT NULL,
    acquired_at  timestamptz NOT NULL,
    ended_at     timestamptz NOT NULL,
    end_reason   text        NOT NULL CHECK (end_reason IN ('released', 'expired')),
    PRIMARY KEY (name, epoch)
);

CREATE TABLE celery_fence.stale_runs (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    recorded_at    timestamptz NOT NULL,
    environment    text        NOT NULL,
    lease_name     text        NOT NULL,
    stale_epoch    bigint,
    stale_holder   text        NOT NULL,
    current_epoch  bigint,
    current_holder text,
    reason         text        NOT NULL CHECK (
        reason IN ('expired', 'superseded', 'released', 'paused', 'forged', 'missing', 'malformed')
    ),
    action         text        NOT NULL,
    enforced       boolean     NOT NULL DEFAULT true
);

CREATE INDEX stale_runs_environment_idx
    ON celery_fence.stale_runs (environment, recorded_at DESC, id DESC);

CREATE INDEX stale_runs_lease_idx
    ON celery_fence.stale_runs (lease_name, recorded_at DESC, id DESC);

CREATE INDEX stale_runs_recorded_idx
    ON celery_fence.stale_runs (recorded_at DESC, id DESC);

-- The answer every protocol function gives: what happened, and the lease as it now stands.
-- The token is filled only for the caller that holds the lease.
CREATE TYPE celery_fence.answer AS (
    outcome       text,
    reason        text,
    name          text,
    environment   text,
    holder        text,
    purpose       text,
    epoch         bigint,
    token         uuid,
    acquired_at   timestamptz,
    renewed_at    timestamptz,
    expires_at    timestamptz,
    hold_until    timestamptz,
    released_at   timestamptz,
    paused        boolean,
    paused_reason text,
    paused_by     text,
    paused_at     timestamptz,
    state         text,
    remaining     double precision
);

CREATE TABLE celery_fence.dispatches (
    schedule      text        NOT NULL,
    entry         text        NOT NULL,
    slot          timestamptz NOT NULL,
    task          text        NOT NULL,
    epoch         bigint      NOT NULL,
    holder        text        NOT NULL,
    dispatched_at timestamptz NOT NULL,
    PRIMARY KEY (schedule, entry, slot)
);

CREATE INDEX dispatches_slot_idx
    ON celery_fence.dispatches (schedule, slot DESC, entry);

-- The deliveries of continuations that joined an epoch of a shared lease (see rejoin), one row
-- each, and when each left it, finished or not: a redelivery of such a message waits while its
-- earlier delivery shares the lease, is dropped once that delivery finished, and joins in its
-- place when it left unfinished (its message put back). Pruned by age (see the runbook).
CREATE TABLE celery_fence.joins (
    name      text        NOT NULL,
    epoch     bigint      NOT NULL,
    delivery  text        NOT NULL,
    joined_at timestamptz NOT NULL,
    left_at   timestamptz,
    finished  boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (name, epoch, delivery)
);
