"""What `preheat serve` starts as soon as its flags are valid, so that it runs beside the HTTP
server's own imports and the model load instead of inside the warmup: the grammar
compiler's forkserver (engine/sample/grammar_worker.py `prestart`). It is a process of its
own importing xgrammar and torch (seconds on a small CPU), so it runs truly in parallel on a
second core, and the warmup's first compile no longer waits for it.

Only when the warmup compiles a grammar (the built-in warmup does, and templates with
`structured` or `tools`): a start with neither spends no process on it. The engine's own
imports are not begun early: they hold the GIL, so a thread beside the server's imports
only delayed the moment /health and /ready first answer.
"""

from __future__ import annotations

from typing import Any


def warmup_compiles_grammars(warm: Any) -> bool:
    """Whether the warmup `warm` (engine/warm/warm_start.WarmStart) will compile a grammar."""
    return bool(warm.builtin) or any(t.structured or t.tools for t in warm.templates)


def start_early(warm: Any) -> None:
    if warmup_compiles_grammars(warm):
        try:
            from preheat.engine.sample import grammar_worker
        except ImportError:  # structured output is optional
            return
        grammar_worker.prestart()
