"""The engine-to-engine credential (the per-service peer secret) and what every peer HTTP call shares."""
