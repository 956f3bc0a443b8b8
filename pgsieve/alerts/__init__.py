"""Alerts: rules evaluated by beat over what the metadata store knows, each alert fired
once, repeated while it fires, resolved, and delivered to webhooks.

Pure core: :mod:`.kinds` (the kinds and their defaults), :mod:`.evaluate` (a facts
snapshot and the rules -> the conditions true now), :mod:`.machine` (pending -> firing
-> repeat -> resolved, and the events to deliver). I/O at the edges: :mod:`.facts`
reads the snapshot from the store, :mod:`.webhook` sends one delivery, :mod:`.engine`
runs a round (beat's ``pgsieve.evaluate_alerts``), :mod:`.service` is what the API
asks (channels and rules, validated).
"""
