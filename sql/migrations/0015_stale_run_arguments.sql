-- celery-fence 0015: no change to the tables. The functions change in what they do, so that a
-- package that relies on it finds them installed: record_stale_run checks the arguments only a
-- record keeps and records a stale run under its own epoch's environment, and resume ends only
-- an epoch whose renewal was refused during the pause.
SELECT 1;
