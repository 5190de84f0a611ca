-- The document service's own tables, beside celery-fence's schema in the same database (a
-- fenced write must run in the database that holds its lease). Idempotent: `seed` runs it.

CREATE SCHEMA IF NOT EXISTS example_app;

-- The maintenance queue: documents and the date each may be removed after.
CREATE TABLE IF NOT EXISTS example_app.documents (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    title           text        NOT NULL,
    retention_until timestamptz NOT NULL
);

-- What a planning run would remove, and the lease epoch it planned under. Planning never
-- deletes a document. One plan per task id: a redelivered task does not plan twice.
CREATE TABLE IF NOT EXISTS example_app.retention_plans (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    lease_name   text        NOT NULL,
    epoch        bigint      NOT NULL,
    holder       text        NOT NULL,
    task_id      text        NOT NULL UNIQUE,
    planned_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    document_ids bigint[]    NOT NULL
);
-- The scheduler lease and epoch of the beat that sent the run; null for a run sent by hand.
-- Added to the table apart, so that a table made before them gets them too.
ALTER TABLE example_app.retention_plans
    ADD COLUMN IF NOT EXISTS scheduled_by text,
    ADD COLUMN IF NOT EXISTS schedule_epoch bigint;

-- The current release of each environment, and which release lease epoch made it current.
CREATE TABLE IF NOT EXISTS example_app.manifests (
    environment  text        PRIMARY KEY,
    release_id   text        NOT NULL,
    commit       text        NOT NULL,
    build        integer     NOT NULL CHECK (build > 0),
    epoch        bigint      NOT NULL,
    rollback     boolean     NOT NULL DEFAULT false,
    published_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- How every release attempt ended. Written outside the fenced transaction, so a rejected
-- publish is logged too.
CREATE TABLE IF NOT EXISTS example_app.releases (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    environment text        NOT NULL,
    release_id  text        NOT NULL,
    commit      text        NOT NULL,
    build       integer     NOT NULL,
    rollback    boolean     NOT NULL,
    task_id     text        NOT NULL,
    epoch       bigint      NOT NULL,
    holder      text        NOT NULL,
    outcome     text        NOT NULL CHECK (outcome IN ('published', 'refused', 'rejected')),
    detail      text        NOT NULL DEFAULT '',
    logged_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
