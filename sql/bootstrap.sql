-- What every install runs first: the schema and the table of applied migrations.
CREATE SCHEMA IF NOT EXISTS celery_fence;

CREATE TABLE IF NOT EXISTS celery_fence.migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
