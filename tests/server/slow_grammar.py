"""A short regex that xgrammar takes a long time to compile, for the compile-limit tests.

`.{0,20000}x` used to be the example, but xgrammar 0.2 compiles bounded repetitions lazily:
it takes ~0.7 s, so a test built on it passed or failed with the machine's load. Each
optional character class here is a grammar state whose token mask is computed at compile
time, and the cost grows faster than the count: measured on a 2-core CI-like machine with
the SmolLM2 tokenizer, 100 classes 1.7 s, 300 classes 18 s - far past the 1-2 s limits the
tests set, under any load."""

from __future__ import annotations

_LETTERS = "abcdefghijklmnopqrstuvwxyz"

SLOW_REGEX = "".join(f"[{_LETTERS[i % 26]}-z]?" for i in range(300))  # 1,800 characters
