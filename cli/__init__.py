"""Preheat: LLM serving on Kubernetes with no user-visible cold start.

`preheat serve` runs the engine; `preheat operator` runs the Kubernetes operator.
"""

__version__ = "0.1.0"

# preheat.operator lives in operator/ with no __init__.py, so that folder can never shadow
# the standard library's `operator`. setuptools' editable finder does not resolve a
# namespace subpackage under a mapped package, so in a source checkout (editable install,
# CI) the repository root is added to the search path of `preheat` only for it; in a
# wheel the files already sit in preheat/operator/.
import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "operator", "main.py")) and _root not in __path__:
    __path__.append(_root)
del _os, _root
