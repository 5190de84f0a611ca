"""Framework integrations; the core never imports them."""
