-- celery-fence 0006: celery_fence.rejoin takes p_environment, the environment a stale run on a
-- lease that does not exist is recorded under, and p_successor and p_delivery_prefix, the holder a
-- continuation takes a lease over as and the holders of its own message's earlier deliveries. The
-- signature without them is dropped, so that the function installed next is the only rejoin.
DROP FUNCTION IF EXISTS celery_fence.rejoin(
    text, bigint, text, text, bytea, interval, text, boolean, timestamptz, interval
);
