-- Runtime queries, one named block each ("-- name: NAME"). Parameters are bound, never formatted.

-- name: acquire
SELECT * FROM celery_fence.acquire(
    :name, :environment, :holder, pg_catalog.make_interval(secs => :ttl),
    pg_catalog.make_interval(secs => :max_hold), :purpose,
    pg_catalog.make_interval(secs => :lock_timeout), :now
)

-- name: renew
SELECT * FROM celery_fence.renew(
    :name, :epoch, :token, pg_catalog.make_interval(secs => :ttl), :holder, :enforced, :now,
    pg_catalog.make_interval(secs => :lock_timeout), :environment
)

-- name: release
SELECT * FROM celery_fence.release(
    :name, :epoch, :token, :holder, :enforced, :now,
    pg_catalog.make_interval(secs => :lock_timeout), :environment, :sharer,
    :finished, :joined_at
)

-- name: rejoin
SELECT * FROM celery_fence.rejoin(
    :name, :epoch, :holder, :mode, :proof, pg_catalog.make_interval(secs => :ttl), :action,
    :enforced, :now, pg_catalog.make_interval(secs => :lock_timeout), :environment, :successor,
    :delivery_prefix, true
)

-- name: fence
-- celery_fence.fence() without the function call on its common path: the writers' key is taken
-- shared (w, evaluated first: the lateral subquery refers to it), the lease row is locked
-- FOR SHARE (the newest version, after any wait) and judged above the lock, so that the clock is
-- read once the lock is held; only a stale epoch (or a missing lease) calls fence() itself,
-- which raises and so aborts the transaction.
SELECT CASE
    WHEN celery_fence.stale_reason(
        f.l, :epoch, :token, coalesce(CAST(:now AS timestamptz), pg_catalog.clock_timestamp())
    ) IS NOT NULL THEN celery_fence.fence(:name, :epoch, :token, :now)::text
    WHEN CAST(:now AS timestamptz) IS NULL THEN pg_catalog.set_config(
        'idle_in_transaction_session_timeout', celery_fence.idle_limit((f.l).expires_at), true
    )
END AS fenced,
-- Whether the idle limit in force is the lease's time left rather than a shorter one the session
-- had (the same answer before the limit is set and after): only then does the server's ending
-- the session idle mean that the lease ran out.
CAST(:now AS timestamptz) IS NULL AND coalesce(
    (f.l).expires_at - pg_catalog.clock_timestamp() <= nullif(
        pg_catalog.current_setting('idle_in_transaction_session_timeout')::interval, interval '0'
    ),
    true
) AS lease_limit
FROM (
    SELECT pg_catalog.pg_advisory_xact_lock_shared(celery_fence.writers_key(:name)), 1 AS queued
    OFFSET 0
) AS w
LEFT JOIN LATERAL (
    SELECT l FROM celery_fence.leases l WHERE l.name = :name AND w.queued = 1 FOR SHARE
) AS f ON true

-- name: check_fence
SELECT * FROM celery_fence.check_fence(:name, :epoch, :token, :now)

-- name: judge
-- Why (epoch, token) no longer holds the lease, or NULL while it does, from the newest committed
-- row, locking nothing: a guard judging afresh on a connection of its own, while its caller's
-- transaction holds the lease's writers' key, must not queue for that key behind a call that
-- waits for the caller.
SELECT celery_fence.stale_reason(
    l, :epoch, :token, coalesce(CAST(:now AS timestamptz), pg_catalog.clock_timestamp())
) AS reason
FROM (VALUES (1)) AS one (x)
LEFT JOIN celery_fence.leases l ON l.name = :name

-- name: record_stale_run
SELECT * FROM celery_fence.record_stale_run(
    :name, :epoch, :holder, :reason, :action, :environment, :enforced, :now
)

-- name: stale_run_environment
-- The environment the latest stale run of a lease's epoch, holder and action was recorded under.
SELECT s.environment FROM celery_fence.stale_runs s
WHERE s.lease_name = :name AND s.stale_epoch = :epoch AND s.stale_holder = :holder
  AND s.action = :action
ORDER BY s.recorded_at DESC, s.id DESC
LIMIT 1

-- name: pause
SELECT * FROM celery_fence.pause(
    :name, :reason, :by, :environment, :now, pg_catalog.make_interval(secs => :lock_timeout)
)

-- name: resume
SELECT * FROM celery_fence.resume(:name, :now, pg_catalog.make_interval(secs => :lock_timeout))

-- name: owner
SELECT * FROM celery_fence.owner(:name, :now)

-- name: leases
-- The clock is read once, in a subquery of its own, so that answer_of() is inlined (see there).
SELECT (celery_fence.answer_of('read', NULL, l, false, t.now)).*
FROM celery_fence.leases l
CROSS JOIN (SELECT coalesce(CAST(:now AS timestamptz), pg_catalog.clock_timestamp()) AS now) t
WHERE CAST(:environment AS text) IS NULL OR l.environment = :environment
ORDER BY l.name

-- name: stale_runs
SELECT * FROM celery_fence.stale_runs s
WHERE (CAST(:environment AS text) IS NULL OR s.environment = :environment)
  AND (CAST(:lease_name AS text) IS NULL OR s.lease_name = :lease_name)
ORDER BY s.recorded_at DESC, s.id DESC
LIMIT :limit

-- name: history
SELECT * FROM celery_fence.history(:name, :now) h
ORDER BY h.epoch DESC
LIMIT :limit

-- name: released_by
SELECT EXISTS (
    SELECT 1 FROM celery_fence.lease_history h
    WHERE h.name = :name AND h.epoch >= :epoch AND h.end_reason = 'released'
      AND pg_catalog.starts_with(h.holder, :prefix)
) AS released

-- name: schema_version
SELECT pg_catalog.max(version) AS version FROM celery_fence.migrations

-- name: bound_lock_wait
SELECT celery_fence.bound_lock_wait(pg_catalog.make_interval(secs => :lock_timeout))

-- name: claim_slot
INSERT INTO celery_fence.dispatches AS d (
    schedule, entry, slot, task, epoch, holder, dispatched_at
) VALUES (
    :schedule, :entry, :slot, :task, :epoch, :holder,
    coalesce(CAST(:now AS timestamptz), pg_catalog.clock_timestamp())
)
ON CONFLICT (schedule, entry, slot) DO NOTHING
RETURNING d.epoch

-- name: dispatches
SELECT * FROM celery_fence.dispatches d
WHERE d.schedule = :schedule
ORDER BY d.slot DESC, d.entry
LIMIT :limit

-- name: entry_dispatches
SELECT * FROM celery_fence.dispatches d
WHERE d.schedule = :schedule AND d.entry = :entry
ORDER BY d.slot DESC
LIMIT :limit

-- name: latest_dispatches
SELECT d.* FROM pg_catalog.unnest(CAST(:entries AS text[])) AS e (entry)
CROSS JOIN LATERAL (
    SELECT * FROM celery_fence.dispatches c
    WHERE c.schedule = :schedule AND c.entry = e.entry
    ORDER BY c.slot DESC
    LIMIT 1
) d
