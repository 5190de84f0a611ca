"""End-to-end tests: real worker and beat processes on a real broker (``-m e2e``)."""
