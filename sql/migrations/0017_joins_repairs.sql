-- celery-fence 0017: repairs databases that installed schema 16 as its first development
-- versions wrote it: the joins table without finished, and release with nine or ten arguments
-- and rejoin with thirteen beside the current ones (every call that leaves out their trailing
-- arguments was ambiguous). With it, a continuation's delivery that leaves a lease no longer
-- held is a stale release, recorded, and rejoin's check (mode join) answers without the token.
ALTER TABLE celery_fence.joins ADD COLUMN IF NOT EXISTS finished boolean NOT NULL DEFAULT false;
DROP FUNCTION IF EXISTS celery_fence.release(
    text, bigint, uuid, text, boolean, timestamptz, interval, text, text
);
DROP FUNCTION IF EXISTS celery_fence.release(
    text, bigint, uuid, text, boolean, timestamptz, interval, text, text, boolean
);
DROP FUNCTION IF EXISTS celery_fence.rejoin(
    text, bigint, text, text, bytea, interval, text, boolean, timestamptz, interval, text, text,
    text
);
