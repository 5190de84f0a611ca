"""A small document service built on celery-fence: the repository's runnable example.

Two jobs use the product. Retention planning runs from beat on several instances at once
(``celery beat -S fence``): a run starts only while the scheduler epoch that sent it is current,
and writes its plan under a lease of its own; it never deletes.
Releases run on workers, one lease per environment: a release validates, "migrates" and
publishes the environment's manifest in a fenced transaction, so a stale or older release can
never overwrite a newer one.

    python -m example_app seed       # the app's tables and some documents
    python -m example_app worker     # celery -A example_app.celery_app worker
    python -m example_app beat       # celery -A example_app.celery_app beat -S fence
    python -m example_app release production r-42 4f2c9e1 42
    python -m example_app status
    python -m example_app demo       # all of it at once, with a report (see docs/how-to)
"""
