"""Warm start: warmup templates, the built-in warmup, hot-prefix snapshots (save, restore, peer transfer) and the peer credential."""
