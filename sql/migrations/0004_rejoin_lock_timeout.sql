-- celery-fence 0004: celery_fence.rejoin takes p_lock_timeout, a bound on its lock waits. The
-- signature without it is dropped, so that the function installed next is the only rejoin.
DROP FUNCTION IF EXISTS celery_fence.rejoin(
    text, bigint, text, text, bytea, interval, text, boolean, timestamptz
);
