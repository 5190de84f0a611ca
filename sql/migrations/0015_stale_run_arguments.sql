-- celery-fence 0015: no change to the tables or types (a type's shape stays, so that the
-- prepared statements of a previous version's running workers keep working). The functions
-- change in what they do, so that a package that relies on it finds them installed:
-- record_stale_run records a stale run under the environment of the epoch that ran, renew,
-- release, rejoin and record_stale_run check the arguments only a record keeps, and resume ends
-- only an epoch whose renewal was refused during the pause.
SELECT 1;
