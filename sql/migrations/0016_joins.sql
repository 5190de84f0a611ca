-- celery-fence 0016: the deliveries that joined a shared epoch (celery_fence.joins), so that a
-- redelivered continuation does not run beside its earlier delivery at the same epoch: rejoin
-- takes p_record_join (off unless given: a previous version's workers, which do not know its
-- answers, join as before), release takes p_sharer, p_finished and p_joined_at, the delivery a
-- sharer leaves as, whether it ran to its end, and when it joined. The signatures without them
-- are dropped, so that the ones installed next are the only ones; a caller that passes the
-- arguments of before calls those.
CREATE TABLE IF NOT EXISTS celery_fence.joins (
    name      text        NOT NULL,
    epoch     bigint      NOT NULL,
    delivery  text        NOT NULL,
    joined_at timestamptz NOT NULL,
    left_at   timestamptz,
    finished  boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (name, epoch, delivery)
);
DROP FUNCTION IF EXISTS celery_fence.release(
    text, bigint, uuid, text, boolean, timestamptz, interval, text
);
DROP FUNCTION IF EXISTS celery_fence.rejoin(
    text, bigint, text, text, bytea, interval, text, boolean, timestamptz, interval, text, text,
    text
);
