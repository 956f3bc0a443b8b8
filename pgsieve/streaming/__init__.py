"""Reading a subscription's slot and keeping it applied: transports (peek/confirm
over SQL), the slot consumer, the per-worker scheduler that gives every subscription its
turn, leases that keep one consumer per slot, the consume pipeline (route, batch, apply,
confirm) and ``pgsieve tail``.
"""
