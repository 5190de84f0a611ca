-- celery-fence 0012: an index of stale runs by lease, newest first: for listing one lease's
-- stale runs, and for resume, which looks for the refusals of the paused epoch.
CREATE INDEX IF NOT EXISTS stale_runs_lease_idx
    ON celery_fence.stale_runs (lease_name, recorded_at DESC, id DESC);
