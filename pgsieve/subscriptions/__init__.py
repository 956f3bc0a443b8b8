"""Subscriptions as a domain: the rules for creating, pausing, skipping and deleting one
(:mod:`.service`), apart from the HTTP layer that calls them."""
