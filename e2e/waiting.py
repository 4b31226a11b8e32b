"""Polling until a condition holds, with the last reason it did not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float,
                     interval: float = 0.05, what: str | None = None) -> Any:
    """Polls check() until it returns something truthy (AssertionError counts as not yet);
    returns that value, or raises the last AssertionError after `timeout` seconds.

    One call of check() is bounded too, by what is left of `timeout` (at least `interval`)
    plus 60 s of grace for a slow but answering check: one that hangs (an API call that never
    answers) fails here with its name, inside the test's own budget, instead of running into
    pytest-timeout, which dumps the threads but not the cluster's diagnostics the tests print
    on a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            try:
                result = await asyncio.wait_for(check(), max(interval, deadline - loop.time()) + 60.0)
            except asyncio.TimeoutError:
                raise AssertionError("did not return (hung)") from None  # named just below
            if result:
                return result
            error = AssertionError(f"{what or check.__name__} stayed {result!r} for {timeout} s")
        except AssertionError as e:
            error = AssertionError(f"{what or check.__name__}: {e} (after {timeout} s)")
        if loop.time() > deadline:
            raise error
        await asyncio.sleep(interval)
