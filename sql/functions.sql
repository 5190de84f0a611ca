-- celery-fence protocol functions. Replaced on every install; any client may call them.
-- Times come from clock_timestamp(), read after the call holds what it decides on (the row, or
-- the lease's writers' key, which comes with every lock the protocol takes on the row), unless
-- the caller passes p_now (tests drive an injected clock through it).

CREATE OR REPLACE FUNCTION celery_fence.state_of(p_row celery_fence.leases, p_now timestamptz)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p_row.name IS NULL THEN 'missing'
        WHEN p_row.paused THEN 'paused'
        WHEN p_row.released_at IS NOT NULL THEN 'released'
        WHEN p_row.expires_at <= p_now THEN 'expired'
        ELSE 'held'
    END
$$;

-- Why (epoch, token) no longer holds p_row; NULL when it still does.
CREATE OR REPLACE FUNCTION celery_fence.stale_reason(
    p_row celery_fence.leases, p_epoch bigint, p_token uuid, p_now timestamptz
) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p_row.name IS NULL THEN 'missing'
        WHEN p_epoch IS NULL OR p_epoch > p_row.epoch THEN 'forged'
        WHEN p_epoch < p_row.epoch THEN 'superseded'
        WHEN p_token IS DISTINCT FROM p_row.token THEN 'forged'
        WHEN p_row.paused THEN 'paused'
        WHEN p_row.released_at IS NOT NULL THEN 'released'
        WHEN p_row.expires_at <= p_now THEN 'expired'
    END
$$;

-- Callers pass p_now as a variable or a column, never as an expression that reads the clock:
-- PostgreSQL inlines this function into the caller's statement only when an argument it uses
-- twice is neither volatile nor costly, and a SQL function that is not inlined has its body
-- parsed and planned again in every transaction, which costs more than the rest of a call.
CREATE OR REPLACE FUNCTION celery_fence.answer_of(
    p_outcome text, p_reason text, p_row celery_fence.leases, p_with_token boolean, p_now timestamptz
) RETURNS celery_fence.answer LANGUAGE sql STABLE AS $$
    SELECT ROW(
        p_outcome, p_reason, p_row.name, p_row.environment, p_row.holder, p_row.purpose,
        p_row.epoch, CASE WHEN p_with_token THEN p_row.token END,
        p_row.acquired_at, p_row.renewed_at, p_row.expires_at, p_row.hold_until, p_row.released_at,
        p_row.paused, p_row.paused_reason, p_row.paused_by, p_row.paused_at,
        celery_fence.state_of(p_row, p_now),
        extract(epoch FROM p_row.expires_at - p_now)::double precision
    )::celery_fence.answer
$$;

-- The transaction-scoped advisory lock key on which acquirers racing for one lease wait
-- together (see acquire): the name's 64-bit hash, seeded so as to stay out of the way of keys an
-- application derives from the same names with the default seed.
CREATE OR REPLACE FUNCTION celery_fence.acquire_key(p_name text)
RETURNS bigint LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT pg_catalog.hashtextextended(p_name, 7161677110969590627)
$$;

-- The advisory lock key of a lease's fenced writers, seeded apart from acquire_key. Each writer
-- takes it shared for its transaction before it locks the lease row FOR SHARE (see fence), and a
-- call that locks the row to change it (acquire, renew, release, rejoin, pause, resume) takes it
-- exclusively first. A waiting exclusive request holds back the shared requests that come after
-- it, so the caller waits once, for the writers already in, and none that overlaps them can keep
-- it waiting: its wait is bounded by one lock_timeout however the writers' transactions overlap.
CREATE OR REPLACE FUNCTION celery_fence.writers_key(p_name text)
RETURNS bigint LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT pg_catalog.hashtextextended(p_name, 5807285632549173253)
$$;

-- A span as a number of seconds ('1 day' becomes '24:00:00'): added to a time, it then moves it by
-- that many seconds also where the session's time zone changes to or from daylight saving time,
-- instead of to the same time on another calendar day.
CREATE OR REPLACE FUNCTION celery_fence.span(p_span interval)
RETURNS interval LANGUAGE sql IMMUTABLE AS $$
    SELECT pg_catalog.make_interval(secs => extract(epoch FROM p_span))
$$;

-- Why a text argument is refused ('celery_fence: <what> must be 1 to <max> characters'), or
-- NULL when it is not. The checks are expressions, not procedures, so that PostgreSQL inlines
-- them into the PL/pgSQL caller's assignment, after which the caller raises the message (SQLSTATE
-- 22023): a call of a function of its own would cost a tenth of an acquisition. STABLE, as
-- format() is: a body more volatile than the function's declaration is not inlined.
CREATE OR REPLACE FUNCTION celery_fence.length_error(p_value text, p_what text, p_max integer)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_value IS NULL OR pg_catalog.length(p_value) NOT BETWEEN 1 AND p_max
        THEN pg_catalog.format('celery_fence: %s must be 1 to %s characters', p_what, p_max)
    END
$$;

-- Why an injected clock is refused, or NULL (also for none): it must be a finite time from 1970
-- to 9998 (UTC). Infinity would make every answer's remaining time fail, for every caller, and
-- the times a call stores from p_now (plus at most a seven-day hold) must be times Python reads.
CREATE OR REPLACE FUNCTION celery_fence.now_error(p_now timestamptz)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_now NOT BETWEEN '1970-01-01 00:00+00' AND '9999-01-01 00:00+00'
        THEN pg_catalog.format(
            'celery_fence: p_now must be a finite time from 1970 to 9998 (UTC), got %s', p_now)
    END
$$;

-- Why a lease name is refused (it must be 1 to 200 characters), or NULL.
CREATE OR REPLACE FUNCTION celery_fence.name_error(p_name text)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT celery_fence.length_error(p_name, 'lease name', 200)
$$;

-- Why a lease name, holder, TTL or maximum hold is refused, or NULL when none is. TTL and
-- maximum hold are judged by the seconds they add to a time (span): compared as they are,
-- intervals count a year as 360 days, and '1 year -359 days' would pass for one day.
CREATE OR REPLACE FUNCTION celery_fence.argument_error(
    p_name text, p_holder text, p_ttl interval, p_max_hold interval
) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        celery_fence.name_error(p_name),
        celery_fence.length_error(p_holder, 'holder', 200),
        CASE WHEN p_ttl IS NULL OR celery_fence.span(p_ttl) <= interval '0'
                  OR celery_fence.span(p_ttl) > interval '1 day'
            THEN pg_catalog.format(
                'celery_fence: ttl must be positive and at most 1 day, got %s',
                coalesce(p_ttl::text, '<NULL>'))
        END,
        -- Whether there is a maximum hold is asked first, so that a call passing NULL for it
        -- (renew, rejoin) has the rest folded away when PostgreSQL plans it, not computed.
        CASE WHEN p_max_hold IS NOT NULL
                  AND (celery_fence.span(p_max_hold) < celery_fence.span(p_ttl)
                       OR celery_fence.span(p_max_hold) > interval '7 days')
            THEN pg_catalog.format(
                'celery_fence: max_hold must be between ttl and 7 days, got %s', p_max_hold)
        END
    )
$$;

-- A span as a timeout setting takes it: whole milliseconds rounded up, at least 1 (0 would mean
-- "no timeout", also for a span already used up) and at most the settings' largest value.
CREATE OR REPLACE FUNCTION celery_fence.timeout_ms(p_span interval)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT least(
        2147483647,
        greatest(1, pg_catalog.ceil(extract(epoch FROM p_span) OPERATOR(pg_catalog.*) 1000))
    )::bigint::text
$$;

-- Sets lock_timeout for the rest of the transaction (or of the calling function, whose SET
-- clause restores it) to p_wait (2 s when null), less the time since p_since when given: what is
-- left of one timeout for the waits that follow a first one.
CREATE OR REPLACE FUNCTION celery_fence.bound_lock_wait(
    p_wait interval, p_since timestamptz DEFAULT NULL
) RETURNS text LANGUAGE sql VOLATILE AS $$
    SELECT pg_catalog.set_config(
        'lock_timeout',
        celery_fence.timeout_ms(
            coalesce(p_wait, interval '2 seconds')
            - coalesce(pg_catalog.clock_timestamp() - p_since, interval '0')
        ),
        true
    )
$$;

-- Why what a stale run's record would keep of a call is refused, or NULL: the holder (at most
-- 200 characters, empty for none), the action (1 to 500) and the caller's environment (1 to 64,
-- or none). The calls that may record one check it first, so that a call is refused whether or
-- not it turns out stale.
CREATE OR REPLACE FUNCTION celery_fence.record_error(
    p_holder text, p_action text, p_environment text
) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        CASE WHEN pg_catalog.length(p_holder) > 200
            THEN 'celery_fence: holder must be at most 200 characters' END,
        celery_fence.length_error(p_action, 'action', 500),
        CASE WHEN p_environment IS NOT NULL
            THEN celery_fence.length_error(p_environment, 'environment', 64) END
    )
$$;

-- Records a stale run under the environment of the epoch it ran at (the lease row's for its
-- current epoch, the history's for an earlier one); for an epoch the lease never had, under the
-- lease's environment, and for a lease that does not exist, under the caller's.
CREATE OR REPLACE FUNCTION celery_fence.record_stale_run(
    p_name text, p_epoch bigint, p_holder text, p_reason text, p_action text,
    p_environment text DEFAULT NULL, p_enforced boolean DEFAULT true, p_now timestamptz DEFAULT NULL
) RETURNS celery_fence.stale_runs LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_record celery_fence.stale_runs;
BEGIN
    v_error := coalesce(
        celery_fence.name_error(p_name),
        celery_fence.record_error(p_holder, p_action, p_environment),
        CASE WHEN p_reason IS NULL OR p_reason NOT IN (
                'expired', 'superseded', 'released', 'paused', 'forged', 'missing', 'malformed')
            THEN pg_catalog.format('celery_fence: no such stale-run reason: %s', p_reason) END,
        celery_fence.now_error(p_now)
    );
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name;
    INSERT INTO celery_fence.stale_runs AS s (
        recorded_at, environment, lease_name, stale_epoch, stale_holder,
        current_epoch, current_holder, reason, action, enforced
    ) VALUES (
        coalesce(p_now, clock_timestamp()),
        coalesce(
            CASE WHEN v_row.epoch = p_epoch THEN v_row.environment END,
            (SELECT h.environment FROM celery_fence.lease_history h
             WHERE h.name = p_name AND h.epoch = p_epoch),
            v_row.environment, p_environment, ''
        ),
        p_name, p_epoch, coalesce(p_holder, ''), v_row.epoch, v_row.holder, p_reason, p_action,
        coalesce(p_enforced, true)
    ) RETURNING s.* INTO v_record;
    RETURN v_record;
END
$$;

CREATE OR REPLACE FUNCTION celery_fence.acquire(
    p_name text,
    p_environment text,
    p_holder text,
    p_ttl interval,
    p_max_hold interval DEFAULT NULL,
    p_purpose text DEFAULT '',
    p_lock_timeout interval DEFAULT interval '2 seconds',
    p_now timestamptz DEFAULT NULL
) RETURNS celery_fence.answer
LANGUAGE plpgsql VOLATILE
SET lock_timeout = '2s'
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_new celery_fence.leases;
    v_now timestamptz;
    v_waited_from timestamptz;
    v_ttl interval := celery_fence.span(p_ttl);
    v_hold interval := coalesce(celery_fence.span(p_max_hold), greatest(v_ttl, interval '24 hours'));
BEGIN
    v_error := coalesce(
        celery_fence.argument_error(p_name, p_holder, p_ttl, p_max_hold),
        celery_fence.length_error(p_environment, 'environment', 64),
        celery_fence.now_error(p_now)
    );
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The SET clause above bounds lock waits to 2 s and restores the setting when the call ends.
    IF p_lock_timeout <> interval '2 seconds' THEN
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout);
    END IF;
    FOR attempt IN 1..5 LOOP
        -- Look before locking: a valid or paused lease is answered without writing anything.
        v_row := NULL;
        SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name;
        v_now := coalesce(p_now, clock_timestamp());
        IF v_row.name IS NOT NULL THEN
            IF v_row.paused THEN
                RETURN celery_fence.answer_of('paused', 'paused', v_row, false, v_now);
            END IF;
            IF v_row.released_at IS NULL AND v_row.expires_at > v_now THEN
                RETURN celery_fence.answer_of('held', NULL, v_row, false, v_now);
            END IF;
            -- Acquirers racing for a free lease wait together for the first one's transaction
            -- (a shared lock on the lease's key) and then look again, rather than queue one by
            -- one on its row. Only the first look does this, so that a later one cannot be kept
            -- out by the others' shared locks.
            IF attempt = 1 AND NOT pg_try_advisory_xact_lock(celery_fence.acquire_key(p_name)) THEN
                v_waited_from := clock_timestamp();
                PERFORM pg_advisory_xact_lock_shared(celery_fence.acquire_key(p_name));
                -- Whatever lock wait follows gets what is left of the timeout, not all of it.
                PERFORM celery_fence.bound_lock_wait(p_lock_timeout, v_waited_from);
                CONTINUE;
            END IF;
            -- The lease looked free. Every transaction of the protocol that locks its row holds
            -- the writers' key (fenced writers shared, every change exclusively) until it ends.
            -- Once this call holds the key, the UPDATE below finds no such lock left to wait for
            -- (only SQL of a client's own that locked the row without the key would make it
            -- wait). It reads the newest row version and judges it by a clock read after the
            -- wait. It takes over only the version looked at: one renewed since, and expired all
            -- the same, is looked at again, so that the history row below records the expiry it
            -- reached.
            PERFORM pg_advisory_xact_lock(celery_fence.writers_key(p_name));
            v_now := coalesce(p_now, clock_timestamp());
            UPDATE celery_fence.leases AS l SET
                environment = p_environment,
                holder = p_holder,
                purpose = coalesce(p_purpose, ''),
                epoch = l.epoch + 1,
                token = gen_random_uuid(),
                acquired_at = v_now,
                renewed_at = v_now,
                expires_at = v_now + v_ttl,
                hold_until = v_now + v_hold,
                released_at = NULL,
                sharers = 1
            WHERE l.name = p_name AND l.epoch = v_row.epoch AND NOT l.paused
              AND l.expires_at = v_row.expires_at
              AND l.released_at IS NOT DISTINCT FROM v_row.released_at
              AND (l.released_at IS NOT NULL OR l.expires_at <= v_now)
            RETURNING l.* INTO v_new;
            IF v_new.name IS NULL THEN
                -- Another acquirer, a renewal or a pause got there first: look again.
                CONTINUE;
            END IF;
            IF v_row.released_at IS NULL THEN
                -- The epoch taken over ended by expiry (a release records its own end).
                INSERT INTO celery_fence.lease_history (
                    name, epoch, environment, holder, purpose, acquired_at, ended_at, end_reason
                ) VALUES (
                    v_row.name, v_row.epoch, v_row.environment, v_row.holder, v_row.purpose,
                    v_row.acquired_at, v_row.expires_at, 'expired'
                )
                ON CONFLICT DO NOTHING;
            END IF;
        ELSE
            INSERT INTO celery_fence.leases AS l (
                name, environment, holder, purpose, epoch, token,
                acquired_at, renewed_at, expires_at, hold_until
            ) VALUES (
                p_name, p_environment, p_holder, coalesce(p_purpose, ''), 1, gen_random_uuid(),
                v_now, v_now, v_now + v_ttl, v_now + v_hold
            )
            ON CONFLICT (name) DO NOTHING
            RETURNING l.* INTO v_new;
        END IF;
        IF v_new.name IS NOT NULL THEN
            RETURN celery_fence.answer_of('acquired', NULL, v_new, true, v_new.acquired_at);
        END IF;
        -- Another acquirer inserted the row first; look again with a fresh snapshot.
    END LOOP;
    v_row := NULL;
    SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name;
    v_now := coalesce(p_now, clock_timestamp());
    RETURN celery_fence.answer_of('busy', NULL, v_row, false, v_now);
END
$$;

CREATE OR REPLACE FUNCTION celery_fence.renew(
    p_name text, p_epoch bigint, p_token uuid, p_ttl interval, p_holder text DEFAULT '',
    p_enforced boolean DEFAULT true, p_now timestamptz DEFAULT NULL,
    p_lock_timeout interval DEFAULT interval '2 seconds', p_environment text DEFAULT NULL
) RETURNS celery_fence.answer LANGUAGE plpgsql VOLATILE
-- As in acquire: the wait behind fenced writers is bounded (lock_not_available), so that one
-- renewal cannot hold up the renewals queued after it.
SET lock_timeout = '2s'
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_now timestamptz;
    v_reason text;
BEGIN
    v_error := coalesce(
        celery_fence.argument_error(p_name, 'renew', p_ttl, NULL),
        celery_fence.record_error(p_holder, 'renew', p_environment),
        celery_fence.now_error(p_now)
    );
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_lock_timeout <> interval '2 seconds' THEN
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout);
    END IF;
    -- The writers' key, then the holder's row, and the clock read after: a renewal that waited
    -- behind a fenced writer past the expiry must not bring the lease back, also when the writer
    -- locked the row without the key (SQL of a client's own), so renewal, unlike acquire and
    -- release, locks the row too. Only the holder's call waits for the writers (a stale one is
    -- answered at once).
    PERFORM pg_advisory_xact_lock(celery_fence.writers_key(p_name)) FROM celery_fence.leases l
    WHERE l.name = p_name AND l.epoch = p_epoch AND l.token = p_token;
    SELECT * INTO v_row FROM celery_fence.leases l
    WHERE l.name = p_name AND l.epoch = p_epoch AND l.token = p_token
    FOR NO KEY UPDATE;
    v_now := coalesce(p_now, clock_timestamp());
    IF v_row.name IS NOT NULL AND v_row.released_at IS NULL AND NOT v_row.paused
       AND v_row.expires_at > v_now THEN
        UPDATE celery_fence.leases AS l SET
            renewed_at = v_now,
            expires_at = greatest(
                l.expires_at, least(v_now + celery_fence.span(p_ttl), l.hold_until)
            )
        WHERE l.name = p_name
        RETURNING l.* INTO v_row;
        RETURN celery_fence.answer_of('renewed', NULL, v_row, true, v_row.renewed_at);
    END IF;
    SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name;
    v_now := coalesce(p_now, clock_timestamp());
    v_reason := coalesce(celery_fence.stale_reason(v_row, p_epoch, p_token, v_now), 'expired');
    PERFORM celery_fence.record_stale_run(
        p_name, p_epoch, p_holder, v_reason, 'renew', p_environment, p_enforced, p_now
    );
    RETURN celery_fence.answer_of('lost', v_reason, v_row, false, v_now);
END
$$;

CREATE OR REPLACE FUNCTION celery_fence.release(
    p_name text, p_epoch bigint, p_token uuid, p_holder text DEFAULT '',
    p_enforced boolean DEFAULT true, p_now timestamptz DEFAULT NULL,
    p_lock_timeout interval DEFAULT interval '2 seconds', p_environment text DEFAULT NULL,
    p_sharer text DEFAULT NULL, p_finished boolean DEFAULT true,
    p_joined_at timestamptz DEFAULT NULL
) RETURNS celery_fence.answer LANGUAGE plpgsql VOLATILE
-- As in renew: the wait behind fenced writers is bounded (lock_not_available), so that a
-- transaction left open cannot hold up the end of a run; a release that gave up changed
-- nothing, and the lease runs out at its expiry.
SET lock_timeout = '2s'
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_now timestamptz;
    v_reason text;
    v_join celery_fence.joins;
    v_held boolean;
    v_synchronous_commit text := current_setting('synchronous_commit');
BEGIN
    v_error := coalesce(
        celery_fence.name_error(p_name),
        celery_fence.record_error(p_holder, 'release', p_environment),
        celery_fence.now_error(p_now)
    );
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A release lost in a server crash only leaves the lease to expire at its TTL, so its commit
    -- need not wait for the disk.
    PERFORM set_config('synchronous_commit', 'off', true);
    -- The SET clause above bounds lock waits to 2 s (on the path of every fenced run's end).
    IF p_lock_timeout <> interval '2 seconds' THEN
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout);
    END IF;
    -- The writers' key first and the clock read after (see acquire), behind the writers already
    -- in (see renew). A lease shared with continuations (see rejoin) is released by the last of
    -- its sharers.
    PERFORM pg_advisory_xact_lock(celery_fence.writers_key(p_name)) FROM celery_fence.leases l
    WHERE l.name = p_name AND l.epoch = p_epoch AND l.token = p_token;
    v_now := coalesce(p_now, clock_timestamp());
    IF p_sharer IS NOT NULL THEN
        -- A continuation's delivery that joined the epoch (see rejoin) leaves it: finished, a
        -- redelivery of its message is dropped from now on; unfinished (its message put back),
        -- its share is kept for the redelivery, which joins in its place (or takes the lease
        -- over once it expired unrenewed). A delivery that left already, or, while the lease is
        -- held, whose join a redelivery took since (p_joined_at, when it joined, tells), leaves
        -- nothing more. Leaving a lease no longer held is a stale release (below), as its
        -- publisher's would be; a join that is gone (pruned) is left as a sharer without one.
        IF p_finished IS NULL THEN
            RAISE EXCEPTION 'celery_fence: finished must be true or false'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        SELECT * INTO v_row FROM celery_fence.leases l
        WHERE l.name = p_name AND l.epoch = p_epoch AND l.token = p_token;
        SELECT * INTO v_join FROM celery_fence.joins j
        WHERE v_row.name IS NOT NULL
          AND j.name = p_name AND j.epoch = p_epoch AND j.delivery = p_sharer
        FOR UPDATE;
        v_held := v_row.released_at IS NULL AND v_row.expires_at > v_now;
        IF v_join.left_at IS NOT NULL AND v_join.joined_at = coalesce(p_joined_at, v_join.joined_at)
            OR v_held AND v_join.joined_at <> coalesce(p_joined_at, v_join.joined_at) THEN
            RETURN celery_fence.answer_of('left', NULL, v_row, false, v_now);
        ELSIF v_held AND v_join.name IS NOT NULL THEN
            UPDATE celery_fence.joins AS j SET left_at = v_now, finished = p_finished
            WHERE j.name = p_name AND j.epoch = p_epoch AND j.delivery = p_sharer;
            IF NOT p_finished THEN
                RETURN celery_fence.answer_of('left', NULL, v_row, false, v_now);
            END IF;
        END IF;
    END IF;
    UPDATE celery_fence.leases AS l SET
        sharers = greatest(l.sharers - 1, 0),
        released_at = CASE WHEN l.sharers <= 1 THEN v_now END,
        expires_at = CASE WHEN l.sharers <= 1 THEN least(l.expires_at, v_now)
                          ELSE l.expires_at END
    WHERE l.name = p_name AND l.epoch = p_epoch AND l.token = p_token
      AND l.released_at IS NULL AND l.expires_at > v_now
    RETURNING l.* INTO v_row;
    IF v_row.name IS NOT NULL THEN
        IF v_row.released_at IS NULL THEN
            RETURN celery_fence.answer_of('left', NULL, v_row, false, v_now);
        END IF;
        INSERT INTO celery_fence.lease_history (
            name, epoch, environment, holder, purpose, acquired_at, ended_at, end_reason
        ) VALUES (
            v_row.name, v_row.epoch, v_row.environment, v_row.holder, v_row.purpose,
            v_row.acquired_at, v_row.released_at, 'released'
        );
        PERFORM pg_notify('celery_fence_released', p_name);
        RETURN celery_fence.answer_of('released', NULL, v_row, false, v_row.released_at);
    END IF;
    SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name;
    v_now := coalesce(p_now, clock_timestamp());
    v_reason := celery_fence.stale_reason(v_row, p_epoch, p_token, v_now);
    IF v_row.epoch = p_epoch AND v_row.token = p_token AND v_row.released_at IS NOT NULL THEN
        -- Releasing twice is harmless, also when the lease was paused in between.
        RETURN celery_fence.answer_of('released', NULL, v_row, false, v_now);
    END IF;
    v_reason := coalesce(v_reason, 'expired');
    -- A stale release's record commits as the caller's session commits, not as a release does.
    PERFORM set_config('synchronous_commit', v_synchronous_commit, true);
    PERFORM celery_fence.record_stale_run(
        p_name, p_epoch, p_holder, v_reason, 'release', p_environment, p_enforced, p_now
    );
    RETURN celery_fence.answer_of('lost', v_reason, v_row, false, v_now);
END
$$;

-- The idle_in_transaction_session_timeout, in milliseconds as set_config takes it, after which
-- the server ends a session left idle in a transaction fenced by a lease expiring at p_expires_at:
-- the time left until then, unless the limit in force is shorter (the session's own, or one an
-- earlier fence in the transaction set for a lease that expires sooner; 0, no limit, is
-- ignored by least()). One expression, so that PostgreSQL inlines it into the fence query.
CREATE OR REPLACE FUNCTION celery_fence.idle_limit(p_expires_at timestamptz)
RETURNS text LANGUAGE sql VOLATILE AS $$
    SELECT celery_fence.timeout_ms(least(
        nullif(
            pg_catalog.current_setting('idle_in_transaction_session_timeout')::interval,
            interval '0'
        ),
        p_expires_at - pg_catalog.clock_timestamp()
    ))
$$;

-- Lock the lease row FOR SHARE in the caller's transaction and say whether (epoch, token) still
-- holds it. While the caller's transaction lasts, no acquisition can replace the lease.
CREATE OR REPLACE FUNCTION celery_fence.check_fence(
    p_name text, p_epoch bigint, p_token uuid, p_now timestamptz DEFAULT NULL
) RETURNS celery_fence.answer LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_now timestamptz;
    v_reason text;
BEGIN
    v_error := celery_fence.now_error(p_now);
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(celery_fence.writers_key(p_name));
    SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name FOR SHARE;
    v_now := coalesce(p_now, clock_timestamp());
    v_reason := celery_fence.stale_reason(v_row, p_epoch, p_token, v_now);
    RETURN celery_fence.answer_of(
        CASE WHEN v_reason IS NULL THEN 'held' ELSE 'stale' END, v_reason, v_row, false, v_now
    );
END
$$;

-- check_fence that aborts the caller's transaction when the lease is no longer held (one
-- statement: it is on the path of every fenced write).
CREATE OR REPLACE FUNCTION celery_fence.fence(
    p_name text, p_epoch bigint, p_token uuid, p_now timestamptz DEFAULT NULL
) RETURNS bigint LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_reason text;
BEGIN
    v_error := celery_fence.now_error(p_now);
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(celery_fence.writers_key(p_name));
    SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name FOR SHARE;
    v_reason := celery_fence.stale_reason(v_row, p_epoch, p_token, coalesce(p_now, clock_timestamp()));
    IF v_reason IS NOT NULL THEN
        RAISE EXCEPTION 'celery_fence: stale epoch (%) for lease %: epoch % is no longer held',
            v_reason, p_name, p_epoch
            USING ERRCODE = 'CF001',
                  DETAIL = format('current epoch %s held by %s', v_row.epoch, v_row.holder),
                  HINT = 'Roll back, then record it with celery_fence.record_stale_run().';
    END IF;
    -- A writer stopped between this check and its COMMIT must not keep the row locked, and so
    -- the lease from its successor, past the lease's expiry: the server then ends its session.
    -- (An injected clock says nothing about when the server's own clock will get there.)
    IF p_now IS NULL THEN
        PERFORM set_config(
            'idle_in_transaction_session_timeout', celery_fence.idle_limit(v_row.expires_at), true
        );
    END IF;
    RETURN p_epoch;
END
$$;

-- The message a header proof signs: lease, epoch, holder and mode, one per line. STABLE, as
-- convert_to() is: a body more volatile than the function's declaration is not inlined.
CREATE OR REPLACE FUNCTION celery_fence.proof_message(
    p_name text, p_epoch bigint, p_holder text, p_mode text
) RETURNS bytea LANGUAGE sql STABLE AS $$
    SELECT pg_catalog.convert_to(
        pg_catalog.concat_ws(E'\n', p_name, p_epoch::text, p_holder, p_mode), 'UTF8'
    )
$$;

-- A continuation (a task published from inside a fenced run) takes up the lease at the epoch it
-- was published under, proving it with HMAC-SHA256(token, proof_message) so that the token never
-- travels. Mode 'resume' (retries and children of a fenced task) shares the lease while it is
-- held (outcome 'joined': one more sharer, so the lease is released only when the last sharer
-- releases it) and, when it was released or expired with no newer epoch, takes it over at the
-- next epoch (outcome 'resumed', held by p_successor, p_holder when null); mode 'join' (tasks
-- dispatched by a fenced beat, which then take leases of their own) only checks that the lease
-- is held at p_epoch, without locking, extending or sharing it. A newer epoch held by a holder
-- starting with p_delivery_prefix is an earlier delivery of the continuation's own message:
-- 'held' (or 'paused') while it holds the lease, taken over once it expired, stale once
-- released. With p_record_join, a resume that joins is kept in joins as the delivery
-- p_delivery_prefix names, and a later one of the same delivery at that epoch answers 'shared'
-- while that join holds, 'done' once it finished. Rejections are recorded.
CREATE OR REPLACE FUNCTION celery_fence.rejoin(
    p_name text, p_epoch bigint, p_holder text, p_mode text, p_proof bytea, p_ttl interval,
    p_action text DEFAULT 'rejoin', p_enforced boolean DEFAULT true, p_now timestamptz DEFAULT NULL,
    p_lock_timeout interval DEFAULT interval '2 seconds', p_environment text DEFAULT NULL,
    p_successor text DEFAULT NULL, p_delivery_prefix text DEFAULT NULL,
    p_record_join boolean DEFAULT false
) RETURNS celery_fence.answer LANGUAGE plpgsql VOLATILE
-- As in acquire: a resume waits for the lease's key and row at most this long (lock_not_available).
SET lock_timeout = '2s'
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_reason text;
    v_now timestamptz;
    v_answer celery_fence.answer;
    v_waited_from timestamptz;
    v_own boolean := false;
    v_join celery_fence.joins;
BEGIN
    v_error := coalesce(
        celery_fence.argument_error(p_name, p_holder, p_ttl, NULL),
        celery_fence.record_error(p_holder, p_action, p_environment),
        celery_fence.now_error(p_now)
    );
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_mode IS NULL OR p_mode NOT IN ('join', 'resume') THEN
        RAISE EXCEPTION 'celery_fence: mode must be join or resume, got %', p_mode
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.length(p_delivery_prefix) > 200 THEN
        RAISE EXCEPTION 'celery_fence: delivery prefix must be at most 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_mode = 'resume' THEN
        -- The lease's key, then its row: the order acquire takes them in, so that a take-over
        -- through acquire below never waits for the key while holding the row. The two waits
        -- share one lock timeout.
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout);
        v_waited_from := clock_timestamp();
        PERFORM pg_advisory_xact_lock(celery_fence.acquire_key(p_name));
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout, v_waited_from);
        PERFORM pg_advisory_xact_lock(celery_fence.writers_key(p_name));
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout, v_waited_from);
        SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name FOR NO KEY UPDATE;
    ELSE
        -- A check locks nothing; recording a stale run can wait (a lock on stale_runs), as long.
        IF p_lock_timeout <> interval '2 seconds' THEN
            PERFORM celery_fence.bound_lock_wait(p_lock_timeout);
        END IF;
        SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name;
    END IF;
    v_now := coalesce(p_now, clock_timestamp());
    v_reason := celery_fence.stale_reason(v_row, p_epoch, v_row.token, v_now);
    IF v_row.name IS NOT NULL AND p_epoch = v_row.epoch AND (
        p_proof IS NULL OR p_holder IS DISTINCT FROM v_row.holder
        OR p_proof <> celery_fence.hmac_sha256(
            uuid_send(v_row.token), celery_fence.proof_message(p_name, p_epoch, p_holder, p_mode))
    ) THEN
        v_reason := 'forged';
    ELSIF v_reason IN ('released', 'expired') AND p_mode = 'resume' THEN
        v_reason := NULL;
    ELSIF v_reason = 'superseded' AND p_mode = 'resume' AND v_row.released_at IS NULL
        AND starts_with(v_row.holder, nullif(p_delivery_prefix, '')) THEN
        -- The newer epoch was taken by an earlier delivery of this continuation's own message
        -- (redelivered after its worker was lost, or past the broker's visibility timeout): not
        -- a stale run, but the same work, which the caller waits for or takes over below once
        -- it expired. Released, it ran to its end: the work is done, and this one is stale.
        v_reason := NULL;
        v_own := true;
    END IF;
    IF p_record_join AND p_mode = 'resume' AND NOT v_own AND v_row.name IS NOT NULL
        AND v_reason IS DISTINCT FROM 'forged' AND nullif(p_delivery_prefix, '') IS NOT NULL THEN
        -- An earlier delivery of this continuation's own message joined this epoch (redelivered
        -- past the broker's visibility timeout while it runs, or after its worker was lost).
        -- Finished, it ran to its end: the work is done, whatever became of the lease since,
        -- and the caller is told so. Still joined, it shares the lease while the lease is held:
        -- the caller is refused as an acquirer would be, and takes the lease over once it
        -- expired, as from a lost delivery. Left unfinished (its message put back), it is gone:
        -- the caller joins in its place.
        SELECT * INTO v_join FROM celery_fence.joins j
        WHERE j.name = p_name AND j.epoch = p_epoch AND j.delivery = p_delivery_prefix;
        IF v_join.finished THEN
            RETURN celery_fence.answer_of('done', NULL, v_row, false, v_now);
        ELSIF v_join.left_at IS NULL AND v_join.name IS NOT NULL AND v_reason IS NULL
            AND v_row.released_at IS NULL AND v_row.expires_at > v_now THEN
            RETURN celery_fence.answer_of('shared', NULL, v_row, false, v_now);
        END IF;
    END IF;
    IF v_reason IS NOT NULL THEN
        -- The lease's own environment, or, for a lease that does not exist, the caller's.
        PERFORM celery_fence.record_stale_run(
            p_name, p_epoch, p_holder, v_reason, p_action, p_environment, p_enforced, p_now
        );
        RETURN celery_fence.answer_of('lost', v_reason, v_row, false, v_now);
    END IF;
    IF p_mode = 'join' THEN
        -- A check: the caller shares nothing, and a join header is no credential for the token.
        RETURN celery_fence.answer_of('joined', NULL, v_row, false, v_now);
    END IF;
    IF v_own AND (v_row.paused OR v_row.expires_at > v_now) THEN
        -- That delivery still holds the lease, or it is paused: the caller is refused as an
        -- acquirer would be, and nothing is recorded.
        RETURN celery_fence.answer_of(
            CASE WHEN v_row.paused THEN 'paused' ELSE 'held' END, NULL, v_row, false, v_now
        );
    END IF;
    IF v_row.released_at IS NOT NULL OR v_row.expires_at <= v_now THEN
        -- Taking a released or expired lease back is a new ownership: a new epoch and token, so
        -- that a stalled earlier delivery of the same work can no longer renew or write.
        v_answer := celery_fence.acquire(
            p_name, v_row.environment, coalesce(p_successor, p_holder), p_ttl,
            greatest(p_ttl, v_row.hold_until - v_row.acquired_at), v_row.purpose,
            p_lock_timeout => p_lock_timeout, p_now => p_now
        );
        v_answer.outcome := CASE WHEN v_answer.outcome = 'acquired' THEN 'resumed' ELSE 'lost' END;
        RETURN v_answer;
    END IF;
    UPDATE celery_fence.leases AS l SET
        renewed_at = v_now,
        -- A join left unfinished (see release) kept its share for this one.
        sharers = l.sharers + CASE WHEN v_join.name IS NULL THEN 1 ELSE 0 END,
        expires_at = greatest(
            l.expires_at, least(v_now + celery_fence.span(p_ttl), l.hold_until)
        )
    WHERE l.name = p_name
    RETURNING l.* INTO v_row;
    IF p_record_join AND nullif(p_delivery_prefix, '') IS NOT NULL THEN
        -- What a redelivery of this message looks for (above); a join its delivery left
        -- unfinished is this one's now.
        INSERT INTO celery_fence.joins AS j (name, epoch, delivery, joined_at)
        VALUES (p_name, p_epoch, p_delivery_prefix, v_now)
        ON CONFLICT (name, epoch, delivery)
        DO UPDATE SET joined_at = v_now, left_at = NULL, finished = false;
    END IF;
    RETURN celery_fence.answer_of('joined', NULL, v_row, true, v_now);
END
$$;

-- The kill switch. Both wait for the fenced transactions already open on the lease (its
-- writers' key, exclusively), at most p_lock_timeout (lock_not_available, nothing changed).
CREATE OR REPLACE FUNCTION celery_fence.pause(
    p_name text, p_reason text, p_by text, p_environment text DEFAULT NULL,
    p_now timestamptz DEFAULT NULL, p_lock_timeout interval DEFAULT interval '2 seconds'
) RETURNS celery_fence.answer LANGUAGE plpgsql VOLATILE
SET lock_timeout = '2s'
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_now timestamptz;
BEGIN
    v_error := coalesce(
        celery_fence.name_error(p_name),
        celery_fence.length_error(p_reason, 'pause reason', 500),
        celery_fence.length_error(p_by, 'who pauses (p_by)', 200),
        celery_fence.now_error(p_now)
    );
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_lock_timeout <> interval '2 seconds' THEN
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout);
    END IF;
    PERFORM pg_advisory_xact_lock(celery_fence.writers_key(p_name));
    v_now := coalesce(p_now, clock_timestamp());
    IF NOT EXISTS (SELECT 1 FROM celery_fence.leases l WHERE l.name = p_name) THEN
        -- A lease paused before it was ever acquired: its stale runs are recorded under the
        -- environment given here, so there must be one.
        v_error := celery_fence.length_error(
            p_environment, 'environment (to pause a lease that does not exist yet)', 64
        );
        IF v_error IS NOT NULL THEN
            RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    INSERT INTO celery_fence.leases AS l (
        name, environment, holder, purpose, epoch, token, acquired_at, renewed_at,
        expires_at, hold_until, released_at, paused, paused_reason, paused_by, paused_at
    ) VALUES (
        p_name, coalesce(p_environment, ''), '', '', 0, gen_random_uuid(), v_now, v_now,
        v_now, v_now, v_now, true, p_reason, p_by, v_now
    )
    -- A lease paused again keeps the time its pause began (see resume).
    ON CONFLICT (name) DO UPDATE SET
        paused = true, paused_reason = excluded.paused_reason, paused_by = excluded.paused_by,
        paused_at = CASE WHEN l.paused THEN l.paused_at ELSE excluded.paused_at END
    RETURNING l.* INTO v_row;
    RETURN celery_fence.answer_of('paused', 'paused', v_row, false, v_now);
END
$$;

CREATE OR REPLACE FUNCTION celery_fence.resume(
    p_name text, p_now timestamptz DEFAULT NULL,
    p_lock_timeout interval DEFAULT interval '2 seconds'
) RETURNS celery_fence.answer LANGUAGE plpgsql VOLATILE
SET lock_timeout = '2s'
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_now timestamptz;
BEGIN
    v_error := coalesce(celery_fence.name_error(p_name), celery_fence.now_error(p_now));
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_lock_timeout <> interval '2 seconds' THEN
        PERFORM celery_fence.bound_lock_wait(p_lock_timeout);
    END IF;
    PERFORM pg_advisory_xact_lock(celery_fence.writers_key(p_name));
    v_now := coalesce(p_now, clock_timestamp());
    -- The epoch the pause found ends here if its renewal was refused during the pause (a stale
    -- renewal recorded for it, reason paused, enforced): told it lost the lease, the holder
    -- stopped trusting it, so the lease is free for a new epoch rather than held by nobody until
    -- it runs out. A holder whose renewal was never refused still trusts its lease, and keeps
    -- it: a write refused in shadow mode, or a dispatched task refused at its start, tells the
    -- holder nothing.
    UPDATE celery_fence.leases AS l SET
        paused = false, paused_reason = NULL, paused_by = NULL, paused_at = NULL,
        expires_at = CASE
            WHEN l.paused AND EXISTS (
                SELECT 1 FROM celery_fence.stale_runs s
                WHERE s.lease_name = l.name AND s.recorded_at >= l.paused_at
                  AND s.stale_epoch = l.epoch AND s.reason = 'paused'
                  AND s.action = 'renew' AND s.enforced
            ) THEN least(l.expires_at, v_now)
            ELSE l.expires_at
        END
    WHERE l.name = p_name
    RETURNING l.* INTO v_row;
    RETURN celery_fence.answer_of(
        CASE WHEN v_row.name IS NULL THEN 'missing' ELSE 'resumed' END, NULL, v_row, false, v_now
    );
END
$$;

CREATE OR REPLACE FUNCTION celery_fence.owner(p_name text, p_now timestamptz DEFAULT NULL)
RETURNS celery_fence.answer LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_error text;
    v_row celery_fence.leases;
    v_now timestamptz;
BEGIN
    v_error := celery_fence.now_error(p_now);
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_error, ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO v_row FROM celery_fence.leases l WHERE l.name = p_name;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_now := coalesce(p_now, clock_timestamp());
    RETURN celery_fence.answer_of('read', NULL, v_row, false, v_now);
END
$$;

-- Who held each epoch of a lease: the ended epochs in lease_history, and the one the lease row
-- still carries (in progress, or expired and not yet taken over).
CREATE OR REPLACE FUNCTION celery_fence.history(p_name text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF celery_fence.lease_history LANGUAGE sql STABLE AS $$
    SELECT l.name, l.epoch, l.environment, l.holder, l.purpose, l.acquired_at,
           CASE WHEN l.expires_at <= c.now THEN l.expires_at END,
           CASE WHEN l.expires_at <= c.now THEN 'expired' END
    FROM celery_fence.leases l, (SELECT coalesce(p_now, pg_catalog.clock_timestamp()) AS now) c
    WHERE l.name = p_name AND l.epoch > 0 AND l.released_at IS NULL
    UNION ALL
    SELECT h.* FROM celery_fence.lease_history h WHERE h.name = p_name
$$;

-- HMAC-SHA256 (RFC 2104) on the built-in sha256(), so that any client can check a header proof.
CREATE OR REPLACE FUNCTION celery_fence.hmac_sha256(p_key bytea, p_message bytea)
RETURNS bytea LANGUAGE plpgsql IMMUTABLE STRICT
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_key bytea := p_key;
    v_inner bytea;
    v_outer bytea;
BEGIN
    IF length(v_key) > 64 THEN
        v_key := sha256(v_key);
    END IF;
    v_key := v_key || decode(repeat('00', 64 - length(v_key)), 'hex');
    v_inner := v_key;
    v_outer := v_key;
    FOR i IN 0..63 LOOP
        v_inner := set_byte(v_inner, i, get_byte(v_key, i) # 54);
        v_outer := set_byte(v_outer, i, get_byte(v_key, i) # 92);
    END LOOP;
    RETURN sha256(v_outer || sha256(v_inner || p_message));
END
$$;
