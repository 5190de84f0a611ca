-- celery-fence 0001: leases, ownership history and stale-run records.

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

CREATE TABLE celery_fence.lease_history (
    name         text        NOT NULL,
    epoch        bigint      NOT NULL,
    environment  text        NOT NULL,
    holder       text        NOT NULL,
    purpose      text        NOT NULL,
    acquired_at  timestamptz NOT NULL,
    ended_at     timestamptz,
    end_reason   text CHECK (end_reason IN ('released', 'expired')),
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
