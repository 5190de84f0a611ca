-- celery-fence 0014: the argument checks became expressions (argument_error, name_error,
-- length_error) that PostgreSQL inlines into each protocol call; the procedures they replace are
-- dropped.
DROP FUNCTION IF EXISTS celery_fence.check_arguments(text, text, interval, interval);
DROP FUNCTION IF EXISTS celery_fence.check_length(text, text, integer);
DROP FUNCTION IF EXISTS celery_fence.check_name(text);
