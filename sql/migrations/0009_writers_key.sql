-- celery-fence 0009: fenced writers take the lease's writers' key shared, and the calls that lock
-- a lease row to change it take it exclusively (celery_fence.writers_key, installed with the
-- functions). No table changes: the new version makes a library that needs the key refuse a
-- database whose functions predate it, until `celery-fence install` brings them up to date.
SELECT 1;
