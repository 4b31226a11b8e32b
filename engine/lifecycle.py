"""Start-up and shutdown of a serving engine, in the order the readiness contract needs.

start-up:  downloading (a hub or S3 model)  ->  loading (build the Engine)  ->  each StartupStep (restoring / warming)  ->  ready
shutdown:  draining (stop admitting, let in-flight finish)  ->  on_shutdown callbacks  ->  stop

The warm-start code plugs in here: snapshot restore and warmup templates are StartupSteps;
persisting the snapshot is an `AsyncEngine.on_shutdown` callback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preheat.engine import termination
from preheat.engine.async_engine import AsyncEngine
from preheat.engine.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass
class StartupStep:
    """Work that must finish before /ready turns 200. `run(aengine)` may be a plain function
    (run in a worker thread, so probes keep answering) or a coroutine function (run on the
    event loop; it can send internal requests with `aengine.generate(..., internal=True)`)."""

    name: str
    phase: str  # "restoring" or "warming": what /ready reports while it runs
    run: Callable[[AsyncEngine], Any]


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """asyncio.to_thread, but on a daemon thread of its own: start-up work (loading the
    model, fetching a snapshot) must not keep a SIGTERMed process alive — the default
    executor's threads are joined when the event loop closes, so a pod deleted while it
    loads would outlive its grace period and be SIGKILLed."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, False, e)
        else:
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=run, name=f"startup-{getattr(fn, '__name__', 'step')}",
                     daemon=True).start()
    return await future


def termination_message(e: BaseException) -> str:
    """What the pod's termination message says about a failed start-up: the reason first
    (ModelUnavailable for a model that does not exist or refused credentials), then why."""
    from preheat.engine.model.download import ModelUnavailable

    reason = termination.MODEL_UNAVAILABLE if isinstance(e, ModelUnavailable) else type(e).__name__
    return f"{reason}: {e}"


def import_engine() -> Any:
    """The engine's imports (torch, transformers, the kernels): their own start-up step, so
    /ready and preheat_startup_step_seconds tell them apart from reading the weights. They
    begin once the server listens: on the main thread before it, they kept /health and
    /ready from answering for seconds; in a thread beside the server's own imports they
    gained nothing (imports hold the GIL) and only delayed it. transformers' AutoConfig is
    not resolved here (half a second on a small CPU): a restart reads the config without it
    (engine/model/config_cache.py), and a first load imports it in `load`."""
    import transformers  # noqa: F401

    from preheat.engine.engine import Engine

    return Engine


def default_engine_factory(config: EngineConfig) -> Any:
    return import_engine()(config)


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux /proc), or None: what the interpreter and
    the server's own imports took before the engine's steps began."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Lifecycle:
    def __init__(
        self,
        config: EngineConfig,
        aengine: AsyncEngine,
        steps: list[StartupStep] | None = None,
        engine_factory: Callable[[EngineConfig], Any] = default_engine_factory,
    ) -> None:
        self.config = config
        self.aengine = aengine
        self.steps = list(steps or [])
        self.engine_factory = engine_factory
        self.failed: BaseException | None = None

    def _record(self, step: str, seconds: float) -> None:
        self.aengine.metrics.startup_seconds.labels(step=step).observe(seconds)
        self.aengine.startup_steps[step] = round(seconds, 3)

    async def start(self) -> bool:
        """Loads and warms the engine; returns False (and logs why) when it cannot serve."""
        ae = self.aengine
        began = time.monotonic()
        try:
            age = process_age_seconds()
            if age is not None:
                self._record("process", age)  # interpreter + server imports, before this
            await self._download()
            ae.set_phase("loading")
            log.info("loading model %s", self.config.model or "(embedded SmolLM2-135M-Instruct)")
            if self.engine_factory is default_engine_factory:
                t = time.monotonic()
                await in_daemon_thread(import_engine)
                self._record("imports", time.monotonic() - t)
            t = time.monotonic()
            engine = await in_daemon_thread(self.engine_factory, self.config)
            self._record("load", time.monotonic() - t)
            ae.attach(engine)
            ae.start(asyncio.get_running_loop())
            for step in self.steps:
                if ae.phase == "draining":
                    return False
                ae.set_phase(step.phase)
                t = time.monotonic()
                log.info("%s: %s", step.phase, step.name)
                if inspect.iscoroutinefunction(step.run):
                    await step.run(ae)
                else:
                    await in_daemon_thread(step.run, ae)
                took = time.monotonic() - t
                self._record(step.name, took)
                log.info("%s: %s done in %.2fs", step.phase, step.name, took)
        except Exception as e:
            self.failed = e
            log.error("start-up failed: %s: %s", type(e).__name__, e)
            termination.write(termination_message(e))
            log.debug("start-up failure", exc_info=True)
            return False
        if ae.phase == "draining":
            return False
        ae.set_phase("ready")
        log.info("ready in %.1fs", time.monotonic() - began)
        # Work that only speeds serving up starts now, not on the way to ready.
        weight_move = getattr(ae.engine, "weight_move", None)
        if weight_move is not None:
            weight_move.start()
        return True

    async def _download(self) -> None:
        """Phase "downloading": a hub or S3 model is fetched into --download-dir (or found
        there complete); the engine then loads the local copy."""
        from preheat.engine.model.download import Progress
        from preheat.engine.model.fetch import fetch_model, needs_download

        if not needs_download(self.config.model):
            return
        ae = self.aengine

        def fetched_bytes(n: int) -> None:
            ae.metrics.model_download_bytes.inc(n)
            ae.metrics.model_download_source_bytes.labels(source=progress.source or "origin").inc(n)

        progress = Progress(on_fetched=fetched_bytes)
        ae.phase_detail = progress.as_dict
        ae.set_phase("downloading")
        t = time.monotonic()
        log.info("downloading model %s", self.config.model)
        try:
            fetched = await in_daemon_thread(fetch_model, self.config.model, self.config.download_dir,
                                             self.config.weight_cache_dir, progress, self.model_peer())
        finally:
            ae.phase_detail = None
        self._record("download", time.monotonic() - t)
        log.info("model %s is at %s (%.1f MB fetched in %.1fs)", self.config.model, fetched.path,
                 progress.fetched / 1e6, time.monotonic() - t)
        self.config = dataclasses.replace(
            self.config, model=fetched.path,
            served_model_name=self.config.served_model_name or fetched.served_name)

    def model_peer(self) -> Any:
        """The peer to take a hub or S3 model from first (--model-peer-url), or None. Needs
        the peer secret: /admin/* on the peer answers nothing else."""
        from preheat.engine.model.peer_fetch import ModelPeer
        from preheat.engine.peer.peer_secret import PeerSecret

        url, secret = self.config.model_peer_url, self.config.peer_secret_file
        if not url:
            return None
        if not secret:
            log.warning("--model-peer-url without --peer-secret-file: the peer's /admin/* "
                        "answers nothing else; downloading from the source")
            return None
        return ModelPeer(url, PeerSecret(secret).keys, self.config.model_peer_timeout)

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Drains, runs the shutdown callbacks, stops the step thread. True when every
        in-flight request finished within the timeout."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        ae = self.aengine
        log.info("draining: %d request(s) in flight, up to %.0fs", ae.num_in_flight, timeout)
        clean = await ae.drain(timeout)
        if ae.engine is not None:
            await asyncio.to_thread(ae.run_shutdown_callbacks)
        ae.stop()
        log.info("stopped (%s)", "all requests finished" if clean else "some requests aborted")
        return clean
