"""The streams behind one HTTP request: each engine request it submitted, run to the end
(`collect`) or interleaved as outputs arrive (`merge`), and the server-sent-events framing.

Shared by the OpenAI routes (openai_serving.py) and SGLang's /generate (engine/sglang/),
so both abort their engine requests the same way when the client leaves: leaving a stream
early closes every stream of the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from preheat.engine.engine_client import OutputStream
from preheat.engine.request.api_errors import APIError
from preheat.engine.request.errors import RequestFailed
from preheat.engine.request.sequence import RequestOutput

DONE = "data: [DONE]\n\n"


@dataclass
class Submitted:
    """One engine request behind one answer (an OpenAI choice, an SGLang output)."""

    index: int
    prompt_ids: list[int]
    stream: OutputStream


async def collect(subs: list[Submitted]) -> list[RequestOutput]:
    """Runs all choices to the end; the last output of each carries its full text."""

    async def last(s: Submitted) -> RequestOutput:
        final = None
        async for out in s.stream:
            final = out
        assert final is not None  # a stream ends with its finished output
        return final

    tasks = [asyncio.ensure_future(last(s)) for s in subs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as e:
        for t in tasks:
            t.cancel()
        for s in subs:
            s.stream.close()
        if isinstance(e, RequestFailed):
            raise APIError(500, str(e), code="request_failed") from None
        raise


async def merge(subs: list[Submitted]) -> AsyncIterator[tuple[Submitted, RequestOutput]]:
    """Interleaves the outputs of several choices as they arrive."""
    if len(subs) == 1:
        try:
            async for out in subs[0].stream:
                yield subs[0], out
        finally:
            subs[0].stream.close()
        return
    queue: asyncio.Queue[tuple[Submitted, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(s: Submitted) -> None:
        try:
            async for out in s.stream:
                queue.put_nowait((s, out))
        except BaseException as e:
            queue.put_nowait((s, e))
        finally:
            queue.put_nowait((s, None))  # this choice is done

    tasks = [asyncio.ensure_future(pump(s)) for s in subs]
    left = len(subs)
    try:
        while left:
            s, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield s, item
    finally:
        for t in tasks:
            t.cancel()
        for s in subs:
            s.stream.close()


def sse(body: object) -> str:
    """One server-sent event holding `body` as compact JSON."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
