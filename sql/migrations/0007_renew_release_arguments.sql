-- celery-fence 0007: celery_fence.renew and celery_fence.release take p_environment, the
-- environment a stale run on a lease that does not exist is recorded under, and release takes
-- p_lock_timeout, a bound on its wait for the holder's row behind fenced writers. The signatures
-- without them are dropped, so that the functions installed next are the only renew and release.
DROP FUNCTION IF EXISTS celery_fence.renew(
    text, bigint, uuid, interval, text, boolean, timestamptz, interval
);
DROP FUNCTION IF EXISTS celery_fence.release(
    text, bigint, uuid, text, boolean, timestamptz
);
