-- celery-fence 0010: celery_fence.pause and celery_fence.resume take p_lock_timeout, a bound on
-- their wait behind the fenced transactions already open on the lease, and pause needs an
-- environment to create a lease that does not exist yet. The signatures without the bound are
-- dropped, so that the functions installed next are the only pause and resume.
DROP FUNCTION IF EXISTS celery_fence.pause(text, text, text, text, timestamptz);
DROP FUNCTION IF EXISTS celery_fence.resume(text, timestamptz);
