-- celery-fence 0016: the deliveries that joined a shared epoch (celery_fence.joins), so that a
-- redelivered continuation does not run beside its earlier delivery at the same epoch, and
-- release takes p_sharer, the delivery a sharer leaves as. The signature without it is dropped,
-- so that the release installed next is the only one; a caller that passes the eight arguments
-- of before calls that one.
CREATE TABLE IF NOT EXISTS celery_fence.joins (
    name      text        NOT NULL,
    epoch     bigint      NOT NULL,
    delivery  text        NOT NULL,
    joined_at timestamptz NOT NULL,
    left_at   timestamptz,
    PRIMARY KEY (name, epoch, delivery)
);
DROP FUNCTION IF EXISTS celery_fence.release(
    text, bigint, uuid, text, boolean, timestamptz, interval, text
);
