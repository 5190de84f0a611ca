-- celery-fence 0003: lease_history keeps the epochs that ended, each written once when it ends
-- (by its release, or by the acquisition that takes the expired lease over). The epoch a lease
-- row still carries is read from the row itself; celery_fence.history() shows both.

DELETE FROM celery_fence.lease_history h
USING celery_fence.leases l
WHERE h.name = l.name AND h.epoch = l.epoch AND h.ended_at IS NULL AND l.released_at IS NULL;

-- An earlier epoch left open (none should be) ends when the next one began.
UPDATE celery_fence.lease_history h SET
    ended_at = coalesce(
        (SELECT min(n.acquired_at) FROM celery_fence.lease_history n
         WHERE n.name = h.name AND n.epoch > h.epoch),
        h.acquired_at
    ),
    end_reason = 'expired'
WHERE h.ended_at IS NULL;

ALTER TABLE celery_fence.lease_history
    ALTER COLUMN ended_at SET NOT NULL,
    ALTER COLUMN end_reason SET NOT NULL;
