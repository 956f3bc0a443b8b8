"""Subscriptions as a domain: the rules for creating, pausing, skipping and deleting one
(:mod:`.service`), for its sync jobs and refreshes (:mod:`.sync_jobs`), and for a
publication change that reconciles them (:mod:`.publication_change`), apart from the HTTP
layer that calls them."""
