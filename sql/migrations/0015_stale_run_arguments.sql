-- celery-fence 0015: an answer that reports a stale run says which environment it was recorded
-- under (record_stale_run now records it under the environment of the epoch that ran, checks the
-- arguments only a record keeps, and resume ends only an epoch whose renewal was refused).
DO $migration_0015$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_catalog.pg_attribute
        WHERE attrelid = 'celery_fence.answer'::pg_catalog.regclass
          AND attname = 'recorded_environment' AND NOT attisdropped
    ) THEN
        ALTER TYPE celery_fence.answer ADD ATTRIBUTE recorded_environment text;
    END IF;
END
$migration_0015$;
