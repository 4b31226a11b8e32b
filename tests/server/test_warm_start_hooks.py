"""The seams the warm-start code plugs into, on a fake engine (no model, milliseconds):
StartupSteps drive /ready's phase, internal requests run before ready, on_shutdown runs
after draining, a cancelled consumer aborts its request, a dead step loop fails liveness."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from types import SimpleNamespace

import httpx
import pytest
from fake_engine import FakeEngine

from preheat.engine.async_engine import AsyncEngine, EngineNotReady
from preheat.engine.config import EngineConfig
from preheat.engine.lifecycle import Lifecycle, StartupStep
from preheat.engine.metrics import Metrics
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.serve.server import create_app


def make(steps=(), engine=None):
    aengine = AsyncEngine(Metrics())
    fake = engine or FakeEngine()
    life = Lifecycle(EngineConfig(), aengine, list(steps), engine_factory=lambda cfg: fake)
    app = create_app(aengine)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return aengine, life, fake, http


async def test_steps_set_the_phase_and_ready_comes_last():
    seen = []

    def restore(ae):  # a plain function runs in a thread
        seen.append(("restore", ae.phase))

    async def warm(ae):  # a coroutine runs on the loop and may send internal requests
        seen.append(("warm", ae.phase))
        with pytest.raises(EngineNotReady):
            ae.submit([1, 2], SamplingParams(max_tokens=2), "user-1")
        outs = [o async for o in ae.generate([1, 2], SamplingParams(max_tokens=3), "w-1",
                                             internal=True)]
        seen.append(("warm-request", outs[-1].finish_reason))

    aengine, life, _, http = make([StartupStep("snapshot", "restoring", restore),
                                   StartupStep("templates", "warming", warm)])
    r = await http.get("/ready")
    assert r.status_code == 503 and r.json()["phase"] == "loading"
    assert await life.start()
    assert seen == [("restore", "restoring"), ("warm", "warming"), ("warm-request", "length")]
    r = await http.get("/ready")
    body = r.json()
    steps = body.pop("startup_steps")
    assert r.status_code == 200 and body == {"phase": "ready", "model": "fake", "in_flight": 0}
    # Each step's seconds, in order ("process": the interpreter's own start, before them).
    assert list(steps) == ["process", "load", "snapshot", "templates"] and all(v >= 0 for v in steps.values())
    assert aengine.metrics.ready._value.get() == 1
    await life.shutdown(1)


async def test_work_that_only_speeds_serving_up_starts_once_ready():
    """The move of the matrices into huge pages (the engine's weight_move) never shares the
    cores with the start: it begins after the last step, with /ready already 200."""
    fake = FakeEngine()
    phases = []
    aengine, life, _, _ = make([StartupStep("templates", "warming", lambda ae: phases.append(("step", ae.phase)))],
                               engine=fake)  # fmt: skip
    fake.weight_move = SimpleNamespace(start=lambda: phases.append(("move", aengine.phase)))
    assert await life.start()
    assert phases == [("step", "warming"), ("move", "ready")]
    await life.shutdown(1)


async def test_a_failing_step_never_turns_ready():
    def broken(ae):
        raise OSError("snapshot volume missing")

    aengine, life, _, http = make([StartupStep("snapshot", "restoring", broken)])
    assert not await life.start()
    assert isinstance(life.failed, OSError)
    r = await http.get("/ready")
    assert r.status_code == 503 and r.json()["phase"] == "restoring"
    await life.shutdown(1)


async def test_shutdown_callbacks_run_after_draining():
    aengine, life, _, http = make()
    assert await life.start()
    seen = []
    aengine.on_shutdown.append(lambda ae: seen.append((ae.phase, ae.num_in_flight)))
    stream = aengine.submit([1], SamplingParams(max_tokens=5), "r-1")
    consumer = asyncio.ensure_future(_drain_stream(stream))
    assert await life.shutdown(5)  # waits for r-1 to finish
    assert (await consumer)[-1].finish_reason == "length"
    assert seen == [("draining", 0)]
    r = await http.get("/ready")
    assert r.status_code == 503 and r.json()["phase"] == "draining"
    aengine.set_phase("ready")  # a late warmup step cannot re-open a draining server
    assert aengine.phase == "draining"


async def test_leaving_a_stream_early_aborts_the_request():
    aengine, life, fake, _ = make()
    assert await life.start()
    async with aclosing(aengine.generate([1], SamplingParams(max_tokens=400), "r-1")) as outs:
        async for _ in outs:
            break
    for _ in range(100):
        if fake.aborted:
            break
        await asyncio.sleep(0.01)
    assert fake.aborted == ["r-1"] and aengine.num_in_flight == 0
    await life.shutdown(1)


async def test_a_dead_step_loop_fails_liveness_and_requests():
    aengine, life, _, http = make(engine=FakeEngine(fail_on_step=True))
    assert await life.start()
    stream = aengine.submit([1], SamplingParams(max_tokens=2), "r-1")
    with pytest.raises(Exception, match="boom"):
        await _drain_stream(stream)
    assert (await http.get("/health")).status_code == 503
    assert (await http.get("/ready")).status_code == 503
    r = await http.post("/v1/completions", json={"model": "fake", "prompt": [1]})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
    await life.shutdown(1)


async def _drain_stream(stream):
    return [o async for o in stream]


async def collect(stream, outs):
    async for out in stream:
        outs.append(out)


@pytest.mark.parametrize("step_seconds, settle", [(0.5, None), (3.0, 0.3)])
async def test_drain_hands_every_stream_its_abort_even_when_steps_are_slow(monkeypatch, step_seconds, settle):
    """The shutdown timeout aborts what is left; each client must still get its finish
    (the race behind a flaky SIGTERM test: drain slept 0.1 s, the step loop was stopped before
    a slow step answered the abort, and the stream ended without a finish_reason). When the
    step loop does not answer in time at all, the streams are ended with "abort" here."""
    from preheat.engine import async_engine

    if settle is not None:
        monkeypatch.setattr(async_engine, "ABORT_SETTLE_S", settle)
    aengine, life, fake, _ = make()
    assert await life.start()
    fake.step_seconds = step_seconds
    outs: list = []
    task = asyncio.ensure_future(collect(aengine.submit([1, 2], SamplingParams(max_tokens=10_000), "r-1"), outs))
    while not outs:
        await asyncio.sleep(0.01)
    await life.shutdown(0.05)
    await asyncio.wait_for(task, 10)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert aengine.num_in_flight == 0


def test_start_up_work_runs_on_a_daemon_thread_that_exit_does_not_wait_for():
    """A pod deleted while its model loads exits at once (SIGTERM -> drain -> exit), rather
    than when the load thread ends: asyncio.run joins the default executor's threads, not
    this one."""
    import threading

    from preheat.engine.lifecycle import in_daemon_thread

    release, started = threading.Event(), threading.Event()

    def slow_load() -> str:
        started.set()
        release.wait(60)
        return "engine"

    async def main() -> None:
        task = asyncio.ensure_future(in_daemon_thread(slow_load))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        task.cancel()

    asyncio.run(main())
    assert not release.is_set()  # asyncio.run returned while the load still runs
    release.set()

    async def ok() -> str:
        return await in_daemon_thread(lambda: "loaded")

    async def boom() -> None:
        def fail() -> None:
            raise RuntimeError("no weights")
        await in_daemon_thread(fail)

    assert asyncio.run(ok()) == "loaded"
    with pytest.raises(RuntimeError, match="no weights"):
        asyncio.run(boom())
