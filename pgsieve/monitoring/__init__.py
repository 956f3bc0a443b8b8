"""Seeing into running pipelines: per-subscription progress and lag history
(:mod:`.progress`), slot health and observations shared by the API and beat
(:mod:`.observe`).
"""
