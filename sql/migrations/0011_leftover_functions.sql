-- celery-fence 0011: drops two functions that upgrades from some development versions left
-- behind: rejoin with eleven arguments (beside the current one, every call that leaves out its
-- trailing arguments was ambiguous) and queue_behind_writers, which nothing calls any more.
DROP FUNCTION IF EXISTS celery_fence.rejoin(
    text, bigint, text, text, bytea, interval, text, boolean, timestamptz, interval, text
);
DROP FUNCTION IF EXISTS celery_fence.queue_behind_writers(text, interval, timestamptz);
