"""Puts tests/ on the import path (pytest does so for a rootdir conftest), so test folders
share helpers such as serve_process.py, and keeps test engines' matrices where they were loaded
(below)."""

import os

# Engines built by tests keep their matrices where they were loaded: the background move into
# huge pages (engine/model/weight_arena.py) swaps them at whichever step starts after its
# copy is done, and tests that wrap the decode stack's native object or count its calls
# would depend on that moment. tests/engine/test_weight_arena.py turns it on where it tests it.
os.environ.setdefault("PREHEAT_HUGE_PAGES", "0")
