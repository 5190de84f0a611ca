-- celery-fence 0008: two repairs for databases installed from early versions. The signature of
-- celery_fence.bound_lock_wait without p_since is dropped, so that the function installed next
-- is the only one (beside it, every call passing one interval was ambiguous). The sharers column
-- of celery_fence.leases is added where 0001 created the table without it.
DROP FUNCTION IF EXISTS celery_fence.bound_lock_wait(interval);
ALTER TABLE celery_fence.leases
    ADD COLUMN IF NOT EXISTS sharers integer NOT NULL DEFAULT 1 CHECK (sharers >= 0);
