-- Runtime queries, one named block each ("-- name: NAME"). Parameters are bound, never formatted.

-- name: acquire
SELECT * FROM celery_fence.acquire(
    :name, :environment, :holder, make_interval(secs => :ttl),
    make_interval(secs => :max_hold), :purpose, make_interval(secs => :lock_timeout), :now
)

-- name: renew
SELECT * FROM celery_fence.renew(
    :name, :epoch, :token, make_interval(secs => :ttl), :holder, :enforced, :now
)

-- name: release
SELECT * FROM celery_fence.release(:name, :epoch, :token, :holder, :enforced, :now)

-- name: rejoin
SELECT * FROM celery_fence.rejoin(
    :name, :epoch, :holder, :mode, :proof, make_interval(secs => :ttl), :action, :enforced, :now
)

-- name: fence
SELECT celery_fence.fence(:name, :epoch, :token, :now)

-- name: check_fence
SELECT * FROM celery_fence.check_fence(:name, :epoch, :token, :now)

-- name: record_stale_run
SELECT * FROM celery_fence.record_stale_run(
    :name, :epoch, :holder, :reason, :action, :environment, :enforced, :now
)

-- name: pause
SELECT * FROM celery_fence.pause(:name, :reason, :by, :environment, :now)

-- name: resume
SELECT * FROM celery_fence.resume(:name, :now)

-- name: owner
SELECT * FROM celery_fence.owner(:name, :now)

-- name: leases
SELECT a.*
FROM celery_fence.leases l
CROSS JOIN LATERAL celery_fence.answer_of(
    'read', NULL, l, false, coalesce(CAST(:now AS timestamptz), clock_timestamp())
) a
WHERE CAST(:environment AS text) IS NULL OR l.environment = :environment
ORDER BY l.name

-- name: stale_runs
SELECT * FROM celery_fence.stale_runs s
WHERE (CAST(:environment AS text) IS NULL OR s.environment = :environment)
  AND (CAST(:lease_name AS text) IS NULL OR s.lease_name = :lease_name)
ORDER BY s.recorded_at DESC, s.id DESC
LIMIT :limit

-- name: history
SELECT * FROM celery_fence.lease_history h
WHERE h.name = :name
ORDER BY h.epoch DESC
LIMIT :limit

-- name: schema_version
SELECT max(version) AS version FROM celery_fence.migrations

-- name: claim_slot
INSERT INTO celery_fence.dispatches AS d (
    schedule, entry, slot, task, epoch, holder, dispatched_at
) VALUES (
    :schedule, :entry, :slot, :task, :epoch, :holder,
    coalesce(CAST(:now AS timestamptz), clock_timestamp())
)
ON CONFLICT (schedule, entry, slot) DO NOTHING
RETURNING d.epoch

-- name: dispatches
SELECT * FROM celery_fence.dispatches d
WHERE d.schedule = :schedule
ORDER BY d.slot DESC, d.entry
LIMIT :limit
