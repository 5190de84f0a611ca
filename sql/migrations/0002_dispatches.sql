-- celery-fence 0002: schedule slots dispatched by a fenced beat, at most once each.

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
