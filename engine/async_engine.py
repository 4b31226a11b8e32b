"""Runs the synchronous Engine in a background thread and feeds asyncio callers.

`Engine.step()` is blocking compute, so it lives on one thread of its own; each request gets
an asyncio queue that the step thread fills through `loop.call_soon_threadsafe`. Cancelling
the consumer (a client hung up) aborts the request, so its KV pages go back at the next step.

The object also carries the readiness phase that /ready reports:
loading -> (restoring) -> (warming) -> ready -> draining.

The serving layer reaches it only through engine/engine_client.py's `EngineClient`
Protocol, which this class implements (tests/server/test_engine_client.py checks that).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from preheat.engine.metrics import PHASES, Metrics
from preheat.engine.request.errors import RequestFailed

if TYPE_CHECKING:
    from preheat.engine.engine import Engine
    from preheat.engine.request.sampling_params import SamplingParams
    from preheat.engine.request.sequence import RequestOutput, Sequence

T = TypeVar("T")

log = logging.getLogger(__name__)

# After the shutdown timeout aborts what is left, how long the step thread gets to hand out
# the abort outputs before the streams are ended here (a step on a loaded CPU takes seconds).
# Short: it is spent inside terminationGracePeriodSeconds (the operator's ShutdownBudget
# reserves it), and streams still open after it get their "abort" end from the event loop.
ABORT_SETTLE_S = 3.0


class EngineNotReady(RuntimeError):
    """The engine is loading, warming or draining and admits no user requests."""


class EngineDead(RuntimeError):
    """The step loop crashed; the process must be restarted."""


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrival: float
    first_token: float | None = None
    prompt_recorded: bool = False
    num_tokens: int = 0


class AsyncEngine:
    def __init__(self, metrics: Metrics, engine: Engine | None = None) -> None:
        self.metrics = metrics
        self.engine: Engine | None = None
        self._phase = "loading"
        metrics.set_phase("loading")
        # What /ready adds to its body for the current phase (downloading: bytes_done, bytes_total).
        self.phase_detail: Callable[[], dict[str, Any]] | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._ids = itertools.count()
        self._abort_pending = False
        # Run once, in order, after draining and before exit (e.g. persist the snapshot).
        self.on_shutdown: list[Callable[[AsyncEngine], object]] = []
        # Seconds each finished start-up step took, in order (engine/lifecycle.py): /ready shows them.
        self.startup_steps: dict[str, float] = {}
        if engine is not None:
            self.attach(engine)

    # ------------------------------------------------------------ phase

    @property
    def phase(self) -> str:
        return self._phase

    def set_phase(self, phase: str) -> None:
        """Moves the readiness phase; /ready is 200 only in "ready"."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        if self._phase == "draining" and phase != "draining":
            return  # draining is final: a late warmup step must not re-open admission
        if phase != self._phase:
            log.info("phase: %s -> %s", self._phase, phase)
        self._phase = phase
        self.metrics.set_phase(phase)

    @property
    def is_ready(self) -> bool:
        return self._phase == "ready" and self.error is None

    # ------------------------------------------------------------ lifecycle

    def attach(self, engine: Engine) -> None:
        """Hands over the loaded engine; the step thread starts with `start()`."""
        self.engine = engine

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.engine is None:
            raise RuntimeError("attach an engine before start()")
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stops the step thread after its current step, waiting up to `timeout` seconds for
        it. True when it ended; False when a step still runs (a large model's prompt chunk on
        a CPU can take longer): the process must then leave without finalizing the
        interpreter (server_main.exit_now), which would abort under a thread inside torch."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()  # tensor-parallel workers stop with the engine
        return not self.stepping

    @property
    def stepping(self) -> bool:
        """Whether the step thread is still running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    async def drain(self, timeout: float) -> bool:
        """Stops admission and waits for in-flight requests; aborts the rest at the deadline.
        Returns True when everything finished on its own."""
        self.set_phase("draining")
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.num_in_flight
        if left:
            log.warning("shutdown timeout: aborting %d in-flight request(s)", left)
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self.abort(rid)
            # The step thread answers each abort with a finished output at its next step;
            # wait for those so every client gets its finish_reason "abort" before the
            # server stops (a fixed short sleep lost that race when a step was slow).
            settle = time.monotonic() + ABORT_SETTLE_S
            while self.num_in_flight and time.monotonic() < settle:
                await asyncio.sleep(0.02)
            self._end_streams_here()
        return left == 0

    def _end_streams_here(self) -> None:
        """Ends, from the event loop, the streams the step thread did not finish in time
        (it is stuck in a long step): each gets an abort output, so clients still see a
        finish_reason rather than a cut connection."""
        from preheat.engine.request.sequence import RequestOutput

        with self._lock:
            streams, self._streams = dict(self._streams), {}
        for rid, stream in streams.items():
            log.warning("request %s: the engine did not answer its abort in time; ended here", rid)
            self.metrics.requests.labels(finish_reason="abort").inc()
            stream.queue.put_nowait(RequestOutput(rid, [], [], [], "", "", True, "abort", 0))

    def run_shutdown_callbacks(self) -> None:
        for cb in self.on_shutdown:
            name = getattr(cb, "__name__", repr(cb))
            try:
                start = time.monotonic()
                cb(self)
                log.info("shutdown step %s done in %.2fs", name, time.monotonic() - start)
            except Exception:
                log.exception("shutdown step %s failed", name)

    # ------------------------------------------------------------ requests

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, *, internal: bool = False
    ) -> RequestStream:
        """Adds a request to the engine now (so a refusal is raised here, before any response
        is started) and returns the stream of its outputs. `internal` requests (warmup) are
        admitted before the phase is ready. Raises the engine's ValueError for a bad request,
        EngineNotReady when not admitting, EngineDead when the step loop crashed."""
        engine = self._check_admitting(internal)
        stream = _Stream(asyncio.Queue(), time.monotonic())
        with self._lock:
            self._streams[request_id] = stream
        try:
            engine.add_request(prompt, params, request_id=request_id)
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        self._wake.set()
        return RequestStream(self, request_id, stream)

    def submit_sequences(self, seqs: list[Sequence], *, internal: bool = False) -> list[RequestStream]:
        """Queues sequences the engine built (`engine.build_sequence`, in a worker thread)
        all at once or none: raises QueueFull when the waiting line has no room for them
        (`--max-queue-len`; internal requests, the warmup's, are not bounded by it),
        EngineNotReady / EngineDead as `submit`."""
        engine = self._check_admitting(internal)
        now = time.monotonic()
        streams = {s.request_id: _Stream(asyncio.Queue(), now) for s in seqs}
        with self._lock:
            self._streams.update(streams)
        try:
            if internal:
                for seq in seqs:
                    engine.enqueue(seq)
            else:
                engine.enqueue_all(seqs)
        except BaseException:
            with self._lock:
                for rid in streams:
                    self._streams.pop(rid, None)
            raise
        self._wake.set()
        return [RequestStream(self, rid, stream) for rid, stream in streams.items()]

    def _check_admitting(self, internal: bool) -> Engine:
        """The engine, when it admits this request now."""
        if self.error is not None:
            raise EngineDead(str(self.error))
        if not internal and not self.is_ready:
            raise EngineNotReady(self._phase)
        if self._thread is None or self.engine is None:
            raise EngineNotReady("loading")
        return self.engine

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, *, internal: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Yields the RequestOutputs of one request until it finishes. The request is built
        (tokenized, its grammar compiled) in a worker thread, not on the event loop. Leaving
        early aborts the request once the generator is closed: wrap it in
        `contextlib.aclosing` to make that immediate (a bare `break` leaves the closing to
        garbage collection)."""
        engine = self._check_admitting(internal)
        seq = await asyncio.to_thread(engine.build_sequence, prompt, params, request_id)
        stream = self.submit_sequences([seq], internal=internal)[0]
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _release(self, request_id: str, abort: bool) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known and abort:
            self.abort(request_id)
            self.metrics.requests.labels(finish_reason="abort").inc()

    def abort(self, request_id: str) -> None:
        if self.engine is None:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:  # an unknown id is already gone: nothing to free
            log.debug("abort of %s ignored", request_id, exc_info=True)
        self._abort_pending = True  # step once even if nothing else is left to run
        self._wake.set()

    # ------------------------------------------------------------ calls on the step thread

    def call_in_engine(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Runs fn(*args) on the step thread before its next step (the KV pool and radix tree
        are not thread-safe) and wakes the loop so an idle engine does not wait its 0.5 s poll.
        Before `start()` there is no step thread: the call runs here, at once."""
        if self._thread is None or self.engine is None:
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)
            return future
        if self.error is not None:
            raise EngineDead(str(self.error))
        future = self.engine.call_soon(fn, *args)
        self._wake.set()
        return future

    async def run_in_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Awaitable form of `call_in_engine`, for code on the event loop."""
        return await asyncio.wrap_future(self.call_in_engine(fn, *args))

    # ------------------------------------------------------------ step thread

    def _run(self) -> None:
        engine = self.engine
        assert engine is not None  # start() checked
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if self._abort_pending:
                    self._abort_pending = False
                elif not engine.has_unfinished():
                    self._update_gauges()
                    self._wake.wait(0.5)
                    continue
                outs = engine.step()
            except BaseException as e:  # the loop must not die silently
                log.exception("engine step failed; the engine is dead")
                self.error = e
                self.metrics.ready.set(0)
                self._fail_all(e)
                return
            # Gauges first: a client that has read the last chunk of its stream and then
            # scrapes /metrics must not still find its request counted as running.
            self._update_gauges()
            if outs:
                self._loop.call_soon_threadsafe(self._dispatch, outs, time.monotonic())  # type: ignore[union-attr]

    def _dispatch(self, outs: list[RequestOutput], t: float) -> None:
        """On the event loop: route outputs to their streams and record per-request metrics."""
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted; its consumer is gone
            new = len(out.new_token_ids or ())
            self.metrics.generation_tokens.inc(new)  # live, so aborted work is counted too
            if new and stream.first_token is None:
                stream.first_token = t
            stream.num_tokens = len(out.token_ids or ())
            if not stream.prompt_recorded and (new or out.finished):
                stream.prompt_recorded = True
                self.metrics.record_prompt(
                    len(out.prompt_token_ids or ()), int(out.cached_tokens or 0)
                )
            if out.finished:
                # Finished: no longer in flight, even if its consumer never reads the rest.
                with self._lock:
                    self._streams.pop(out.request_id, None)
                ttft = None if stream.first_token is None else stream.first_token - stream.arrival
                self.metrics.record_finished(
                    out.finish_reason or "unknown", ttft, t - stream.arrival, stream.num_tokens
                )
            stream.queue.put_nowait(out)

    def _fail_all(self, err: BaseException) -> None:
        if self._loop is None:
            return
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            self._loop.call_soon_threadsafe(s.queue.put_nowait, err)

    def _update_gauges(self) -> None:
        if self.engine is None:
            return
        try:
            st = self.engine.stats()
        except Exception:
            return
        m = self.metrics
        for attr, gauges in (
            ("num_running", (m.num_running, m.vllm_num_running)),
            ("num_waiting", (m.num_waiting, m.vllm_num_waiting)),
            ("kv_usage", (m.kv_usage, m.vllm_kv_usage)),
        ):
            value = getattr(st, attr, None)
            if value is not None:
                for gauge in gauges:
                    gauge.set(value)
        used, cached = getattr(st, "kv_used_pages", None), getattr(st, "kv_cached_pages", None)
        if used is not None and cached is not None:
            m.kv_request_pages.set(max(0, used - cached))
        m.record_scheduler(st)
        m.record_tiers(self.engine)  # on the step thread, which owns the engine's tier counters


class RequestStream:
    """The outputs of one request. Iterate it once; leaving the loop early (break, cancel,
    exception) or calling close() before the end aborts the request and frees its pages."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._owner = owner
        self._stream = stream
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Yields outputs; raises EngineDead when the step loop died and RequestFailed when
        this request failed on its own (finish_reason "error"; the engine serves on)."""
        try:
            while not self.finished:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDead(str(item))
                self.finished = bool(item.finished)
                if item.finish_reason == "error":
                    raise RequestFailed(item.error or "the request failed in the engine")
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._owner._release(self.request_id, abort=not self.finished)
