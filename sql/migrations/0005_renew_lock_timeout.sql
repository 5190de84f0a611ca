-- celery-fence 0005: celery_fence.renew takes p_lock_timeout, a bound on its wait for the
-- holder's row behind fenced writers. The signature without it is dropped, so that the function
-- installed next is the only renew.
DROP FUNCTION IF EXISTS celery_fence.renew(
    text, bigint, uuid, interval, text, boolean, timestamptz
);
