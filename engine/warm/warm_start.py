"""Wires warm start into `preheat serve`: which start-up steps run, what runs at shutdown.

    loading -> restoring (snapshot, if --snapshot-dir) -> warming (the built-in warmup,
    unless --skip-server-warmup; then the templates, if --warmup-templates) -> ready
    ...        draining -> save snapshot -> exit

Templates are loaded and validated when the server is built, before the model loads: a bad
template is an operator's configuration error, so `preheat serve` exits at once (status 2)
with every problem named by file and field, instead of loading for seconds and then failing
(or, worse, turning ready without the warmup the operator asked for).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from preheat.engine.config import EngineConfig
from preheat.engine.lifecycle import StartupStep
from preheat.engine.peer.peer_secret import PeerSecret
from preheat.engine.warm.builtin_warmup import builtin_templates
from preheat.engine.warm.snapshotter import Snapshotter, kv_bytes_per_token
from preheat.engine.warm.warmup_runner import WarmupReport, WarmupState, run_warmup
from preheat.engine.warm.warmup_templates import DEFAULT_MAX_TOKENS, WarmupTemplate, build_plan, load_templates

log = logging.getLogger(__name__)


def plan_limits(engine: Any, max_tokens: int) -> dict[str, Any]:
    """build_plan's engine-dependent arguments. On CPU there are no captured batch sizes, so
    the templates' own concurrency ladders decide. `max_tokens` is the longest answer; a
    staggered wave decodes up to one step more per batch size (hence the margin)."""
    batch_sizes = list(getattr(engine, "cuda_graph_batch_sizes", None) or [])
    margin = len(batch_sizes) + 16
    return {
        "batch_sizes": batch_sizes,
        "max_concurrency": engine.config.max_num_seqs,
        "max_prompt_tokens": max(1, int(engine.max_model_len) - max_tokens - margin - 1),
    }


async def warm_streaming_response() -> None:
    """The server's first streamed response imports anyio's asyncio backend, sockets and
    memory streams (~20 ms of imports on a 2-core CPU; seen as the only modules a first chat
    request loaded after a full warmup). One in-process StreamingResponse pays that here."""
    from starlette.responses import StreamingResponse

    done = asyncio.Event()

    async def body():
        yield "data: {}\n\n"

    async def receive() -> dict:
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    # spec_version < 2.4: the disconnect-listening task group path, as behind uvicorn.
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "method": "POST", "path": "/", "headers": []}
    await StreamingResponse(body(), media_type="text/event-stream")(scope, receive, send)


@dataclass
class WarmStart:
    templates: list[WarmupTemplate] = field(default_factory=list)
    snapshotter: Snapshotter | None = None
    peer_secret: PeerSecret | None = None  # --peer-secret-file: /admin/* and snapshot signing
    builtin: bool = True  # the built-in warmup (off with --skip-server-warmup)
    warmup_steps: int = DEFAULT_MAX_TOKENS
    # What the steps warmed so far: the templates skip what the built-in warmup ran.
    state: WarmupState = field(default_factory=WarmupState)
    reports: list[WarmupReport] = field(default_factory=list)  # one per warming step run

    async def _run(self, aengine: Any, templates: list[WarmupTemplate], levels: set[int]) -> None:
        engine = aengine.engine
        longest_answer = max((t.max_tokens or self.warmup_steps for t in templates), default=1)
        limits = plan_limits(engine, longest_answer)
        limits["batch_sizes"] = sorted(set(limits["batch_sizes"]) | levels)
        plan = build_plan(templates, **limits, default_max_tokens=self.warmup_steps,
                          reached=self.state.levels)
        if engine.cuda_graph_batch_sizes:
            log.info("warmup: replaying captured CUDA-graph batch sizes %s",
                     engine.cuda_graph_batch_sizes)
        self.reports.append(await run_warmup(aengine, plan, aengine.metrics, self.state))
        await warm_streaming_response()

    async def warm_builtin(self, aengine: Any) -> None:
        """The "warmup" StartupStep: the built-in warmup (engine/warm/builtin_warmup.py). It
        reaches the templates' concurrency levels too, so their step need not again."""
        engine = aengine.engine
        levels = {n for t in self.templates for n in t.concurrency}
        await self._run(aengine, builtin_templates(engine.chunked_prefill_size, engine.pool.page_size), levels)

    async def warm(self, aengine: Any) -> None:
        """The "templates" StartupStep: what the built-in warmup did not warm already."""
        await self._run(aengine, self.templates, set())

    @staticmethod
    def record_engine(aengine: Any) -> None:
        """Start-up facts of the loaded engine that only the engine knows."""
        engine = aengine.engine
        aengine.metrics.cuda_graph_capture_seconds.set(
            float(getattr(engine, "cuda_graph_capture_seconds", 0.0) or 0.0))
        pool = getattr(engine, "pool", None)
        if pool is not None:
            aengine.metrics.kv_capacity_tokens.set(pool.capacity_pages * pool.page_size)
        # What a snapshot takes per token, and the converted weights beside it: the
        # operator checks spec.snapshot.size against them (operator/snapshot_storage.py).
        fingerprint = getattr(engine, "fingerprint", None)
        if isinstance(fingerprint, dict) and "num_layers" in fingerprint:
            aengine.metrics.kv_bytes_per_token.set(kv_bytes_per_token(fingerprint))
        from preheat.engine.model.loader import weight_cache_entry_bytes

        aengine.metrics.weight_cache_bytes.set(weight_cache_entry_bytes(getattr(engine, "hf_dir", None))
                                               + weight_cache_entry_bytes(getattr(engine, "prepared_dir", None)))
        log.info("weights %s; CUDA-graph batch sizes %s",
                 "from the weight cache" if getattr(engine, "weights_from_cache", False)
                 else "converted (not from the weight cache)",
                 getattr(engine, "cuda_graph_batch_sizes", None) or "none")

    def steps(self) -> list[StartupStep]:
        steps = [StartupStep("engine-facts", "loading", self.record_engine)]
        if self.snapshotter is not None:
            steps.append(StartupStep("snapshot", "restoring", self.snapshotter.restore_step))
        if self.builtin:
            steps.append(StartupStep("warmup", "warming", self.warm_builtin))
        if self.templates:
            steps.append(StartupStep("templates", "warming", self.warm))
        return steps

    def shutdown_callbacks(self) -> list[Any]:
        return [self.snapshotter.save_at_shutdown] if self.snapshotter is not None else []


def build_warm_start(config: EngineConfig, metrics: Any) -> WarmStart:
    """Raises TemplateError (one line per problem) when the template directory is invalid,
    PeerSecretError when --peer-secret-file holds no usable key."""
    ws = WarmStart(builtin=not config.skip_server_warmup, warmup_steps=config.warmup_steps)
    if config.peer_secret_file:
        ws.peer_secret = PeerSecret(config.peer_secret_file)
        log.info("peer secret: %d key(s) from %s; /admin/* answers only it",
                 len(ws.peer_secret.keys().accepted), config.peer_secret_file)
    if config.warmup_templates:
        ws.templates = load_templates(config.warmup_templates)
        log.info("warmup templates: %s from %s", ", ".join(t.name for t in ws.templates) or "none",
                 config.warmup_templates)
    if config.snapshot_dir:
        metrics.snapshot_max_tokens.set(config.snapshot_max_tokens)
        ws.snapshotter = Snapshotter(config.snapshot_dir, config.snapshot_max_tokens,
                                     config.snapshot_interval, metrics,
                                     peer_url=config.snapshot_peer_url,
                                     peer_secret=ws.peer_secret,
                                     peer_timeout=config.snapshot_peer_timeout,
                                     shutdown_timeout=config.shutdown_snapshot_timeout,
                                     max_bytes=config.snapshot_max_bytes,
                                     max_candidates=config.snapshot_restore_candidates)
    return ws
