"""`preheat router`: a cache-aware, warm-aware proxy in front of one InferenceService's
engines (docs/router.md). Pure decision in policy.py, thin I/O shells around it."""
