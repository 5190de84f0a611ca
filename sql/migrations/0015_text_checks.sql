-- celery-fence 0015: the text arguments of the protocol functions are checked as the Python
-- library checks them (printable, no surrounding space, its limits) by text_error, installed with
-- the functions; length_error, which checked only their length, is dropped.
DROP FUNCTION IF EXISTS celery_fence.length_error(text, text, integer);
