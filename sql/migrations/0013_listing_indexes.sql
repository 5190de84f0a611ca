-- celery-fence 0013: indexes for the listings that read a table newest first without a filter of
-- their own: every environment's stale runs (and a retention DELETE by recorded_at), and one
-- schedule's dispatches by slot. To keep a large table writable during the upgrade, build them
-- beforehand, concurrently, with the same names and columns (docs/how-to/production.md,
-- "Upgrading"): this migration then finds them and builds nothing.
CREATE INDEX IF NOT EXISTS stale_runs_recorded_idx
    ON celery_fence.stale_runs (recorded_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS dispatches_slot_idx
    ON celery_fence.dispatches (schedule, slot DESC, entry);
