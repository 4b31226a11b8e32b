"""Preheat: LLM serving on Kubernetes with no user-visible cold start.

`preheat serve` runs the engine; `preheat operator` runs the Kubernetes operator.
"""

__version__ = "0.1.0"
