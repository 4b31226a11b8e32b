"""Scheduling: the pure step planner and speculative drafting."""
