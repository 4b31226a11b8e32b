"""Runs a warmup plan (engine/warm/warmup_templates.py) on a serving engine before /ready.

Order matters: pins first (prefill each shared prefix once, then pin it so it is never
evicted and goes first into snapshots), then the waves, each submitted at once so the running
batch reaches the wave's size (every decode batch size / CUDA-graph size replays once), with
every grammar compiled through the same path a user request takes (`engine.build_sequence`).

Prompts are built exactly as the OpenAI server builds them (chat template, then encode without
special tokens; raw prompts encoded with them), or the warmed prefixes would not be the ones a
real request matches. A request the engine refuses (e.g. longer than this model's context) is
logged and skipped: the templates were valid, the pod must still become ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from preheat.engine.api import chat_render
from preheat.engine.api.chat_render import ToolRendering, engine_tool_rendering
from preheat.engine.request.sampling_params import SamplingParams, StructuredOutput
from preheat.engine.tools.calling import ToolPlan, plan_tools, tool_structured_output
from preheat.engine.warm.warmup_templates import ChatMessage, PinnedPrefix, WarmupPlan, WarmupRequest, filler_token_ids

log = logging.getLogger(__name__)

# A user turn appended to a system message to find which of its tokens every conversation
# shares (the chat template may change how the system block ends once a user turn follows).
_PROBE_USER = "Hello"
_OTHER_PROBE_USER = "Thanks"


# --------------------------------------------------------------------------- prompts (pure)


def _plan(req: WarmupRequest) -> ToolPlan | None:
    if req.tools is None:
        return None
    choice = json.loads(req.tool_choice) if req.tool_choice is not None else None
    return plan_tools(json.loads(req.tools), choice, req.parallel_tool_calls)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage | dict],
                    tools: Sequence[dict] | None = None, rendering: ToolRendering | None = None) -> list[int]:
    """Token ids of a chat request, as engine/api/chat_tools.py `ChatTools.prompt_ids` builds them
    (engine/api/chat_render.py renders both; `tools` as a ToolPlan holds them)."""
    conv = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
    return chat_render.chat_prompt_ids(tokenizer, conv, tools, rendering)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return list(a[:n])


def chat_pin_ids(tokenizer: Any, system: str | None, tools: Sequence[dict] | None = None,
                 rendering: ToolRendering | None = None) -> list[int]:
    """The tokens every conversation with this system message (and these tools) starts with."""
    if tools:
        # The tool section may sit in the system block or be the whole of it: what two
        # different first user turns share is what every conversation shares.
        head = [{"role": "system", "content": system}] if system is not None else []
        a, b = ([*head, {"role": "user", "content": probe}] for probe in (_PROBE_USER, _OTHER_PROBE_USER))
        return common_prefix(chat_prompt_ids(tokenizer, a, tools, rendering),
                             chat_prompt_ids(tokenizer, b, tools, rendering))
    assert system is not None
    alone = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False),
        add_special_tokens=False,
    )
    with_user = chat_prompt_ids(
        tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": _PROBE_USER}]
    )
    return common_prefix(alone, with_user)


def text_pin_ids(tokenizer: Any, text: str) -> list[int]:
    """The tokens every raw prompt starting with `text` shares: all but the last token, which a
    BPE tokenizer may merge with whatever text follows."""
    return list(tokenizer.encode(text))[:-1]


def pin_ids(tokenizer: Any, pin: PinnedPrefix, rendering: ToolRendering | None = None) -> list[int]:
    if pin.kind == "chat":
        tools = plan_tools(json.loads(pin.tools)) if pin.tools else None
        return chat_pin_ids(tokenizer, pin.text, tools.tools if tools else None, rendering)
    assert pin.text is not None
    return text_pin_ids(tokenizer, pin.text)


def request_ids(tokenizer: Any, req: WarmupRequest, salt: int, rendering: ToolRendering | None = None) -> list[int]:
    if req.messages is not None:
        plan = _plan(req)
        return chat_prompt_ids(tokenizer, req.messages, plan.tools if plan else None, rendering)
    if req.prompt is not None:
        return list(tokenizer.encode(req.prompt))  # as /v1/completions encodes a string prompt
    assert req.prompt_tokens is not None
    return filler_token_ids(lambda t: tokenizer.encode(t, add_special_tokens=False), req.prompt_tokens, salt)


def request_params(req: WarmupRequest, rendering: ToolRendering | None = None) -> SamplingParams:
    """As the server sets them, grammar included: a tool grammar is built by the same
    function from the same tools, so it is the very text the compile cache is keyed by."""
    structured = None
    if req.structured is not None:
        spec = req.structured.spec if req.structured.kind != "json_object" else None
        structured = StructuredOutput(req.structured.kind, spec)
    plan = _plan(req)
    if plan is not None:
        assert rendering is not None, "a request with tools needs the engine's tool rendering"
        structured = tool_structured_output(plan, rendering.fmt, structured)
    # A fixed seed: warmup is reproducible from one start to the next. ignore_eos: a request
    # runs its planned decode steps (a staggered wave's batch sizes depend on it).
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, seed=0,
                          structured=structured, ignore_eos=True,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty)


def prompts_to_prime(prompts: Sequence[tuple[Sequence[int], int]], page_size: int) -> list[int]:
    """For the (token ids, cached tokens) of a staggered wave's requests: the index of the
    first of each distinct prompt with more than a page not cached. A staggered wave only
    steps down through its levels when all of its requests are admitted in one step, and
    the scheduler admits fewer: those past the step's prefill budget wait, and so does a
    request whose next tokens another is computing (engine/sched/plan.py, deferred to a
    sharer). Prefilled first, every prompt of the wave has at most its last page to
    compute, and nothing to wait for."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for i, (ids, have) in enumerate(prompts):
        key = tuple(ids)
        if len(ids) - have > page_size and key not in seen:
            seen.add(key)
            out.append(i)
    return out


# --------------------------------------------------------------------------- the report


@dataclass
class TemplateReport:
    name: str
    pins: int = 0
    pinned_tokens: int = 0
    requests: int = 0
    refused: int = 0
    skipped: int = 0  # already warm (restored from a snapshot, grammar compiled): not run
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kinds: Counter = field(default_factory=Counter)
    grammars: set[str] = field(default_factory=set)
    concurrency: set[int] = field(default_factory=set)

    def add_grammars(self, req: WarmupRequest) -> None:
        if req.structured is not None:
            self.grammars.add(req.structured.kind)
        tool_plan = _plan(req)
        if tool_plan is not None and tool_plan.active:
            self.grammars.add(f"tools:{tool_plan.mode}")

    def line(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items())) or "none"
        parts = [
            f"warmed {self.name}:",
            f"pinned {self.pins} prefix(es) / {self.pinned_tokens} tokens;",
            f"{self.requests} request(s) ({kinds});",
            f"grammars {', '.join(sorted(self.grammars)) or 'none'};",
            f"concurrency {','.join(map(str, sorted(self.concurrency))) or '-'};",
            f"prompt tokens {self.prompt_tokens}, cached {self.cached_tokens}",
        ]
        if self.skipped:
            parts.append(f"; {self.skipped} skipped (already warm)")
        if self.refused:
            parts.append(f"; {self.refused} refused by the engine (see warnings)")
        return " ".join(parts)


@dataclass
class WarmupReport:
    templates: dict[str, TemplateReport]
    seconds: float = 0.0
    requests: int = 0

    def for_template(self, name: str) -> TemplateReport:
        return self.templates.setdefault(name, TemplateReport(name))


# --------------------------------------------------------------------------- running


async def _drain(stream: Any) -> Any:
    last = None
    async for out in stream:
        last = out
    return last


async def _run_batch(aengine: Any, items: list[tuple[str, list[int], SamplingParams]]) -> list[Any]:
    """Builds every request (in a worker thread: grammars compile there, and the probes keep
    answering), submits them together (so they are admitted into one batch), then waits for
    all. Returns the final output per item, or the ValueError the engine refused it with."""
    engine = aengine.engine

    def build() -> list[Any]:
        built: list[Any] = []
        for label, ids, params in items:
            try:
                built.append(engine.build_sequence(ids, params, aengine.new_request_id(f"warmup-{label}")))
            except ValueError as e:  # too long for this model, a grammar xgrammar refuses, ...
                built.append(e)
        return built

    built = await asyncio.to_thread(build)
    queued = iter(aengine.submit_sequences([b for b in built if not isinstance(b, ValueError)], internal=True))
    streams = [b if isinstance(b, ValueError) else next(queued) for b in built]
    waiting = [_drain(s) for s in streams if not isinstance(s, ValueError)]
    finals = iter(await asyncio.gather(*waiting))
    return [s if isinstance(s, ValueError) else next(finals) for s in streams]


def cached_tokens(engine: Any, ids: list[int]) -> int:
    """Tokens of `ids` the prefix cache holds, page-aligned (stepping thread; 0 without a
    prefix cache)."""
    kv = getattr(engine, "kv", None)
    if kv is None or not ids:
        return 0
    return kv.peek_prefix([*ids, 0]).length  # peek_prefix matches all but the last token


def code_path(req: WarmupRequest, params: SamplingParams) -> tuple:
    """What a request warms beyond its prompt's KV and its grammar's compile: the kind of
    prompt, the kind of grammar the sampler masks with and the sampler's own path. Two
    requests with the same path and a cached prompt warm nothing the other did not but
    their grammar, which compiling alone warms (`_compile_only`)."""
    s = params.structured
    return (req.kind, s.kind if s else None, params.temperature > 0, params.needs_penalties)


@dataclass
class WarmupState:
    """What this process has warmed so far. The built-in warmup and the templates share one
    (engine/warm/warm_start.py), so the templates do not run again what the built-in
    warmup ran: a code path once, the concurrency levels once."""

    paths: set = field(default_factory=set)
    levels: set[int] = field(default_factory=set)


async def _already_warm(aengine: Any, items: list, seen: set, ladder: bool) -> list[bool]:
    """For each (label, ids, params, req) of a wave: whether it would warm nothing new, i.e.
    its code path ran already and its prompt is cached but for the last page (restored from
    a snapshot, or run before). Nothing of a ladder is (its batch sizes are its point).
    Marks the paths of those that will run as seen."""
    engine = aengine.engine
    ps = engine.pool.page_size
    cached = await aengine.run_in_engine(lambda: [cached_tokens(engine, ids) for _, ids, _, _ in items])
    skip = []
    for (_, ids, params, req), have in zip(items, cached):
        path = code_path(req, params)
        warm = not ladder and path in seen and have >= len(ids) - ps
        seen.add(path)
        skip.append(warm)
    return skip


async def _prime(aengine: Any, items: list, metrics: Any) -> int:
    """Prefills a staggered wave's prompts (one request each, one token; see
    `prompts_to_prime`) so that the wave is admitted in one step. Nothing to do when they
    are cached (restored from a snapshot). Returns the requests run."""
    engine = aengine.engine
    cached = await aengine.run_in_engine(lambda: [cached_tokens(engine, ids) for _, ids, _, _ in items])
    chosen = prompts_to_prime([(ids, have) for (_, ids, _, _), have in zip(items, cached)], engine.pool.page_size)
    if chosen:
        await _run_batch(aengine, [(items[i][0], items[i][1], SamplingParams(max_tokens=1, temperature=0))
                                   for i in chosen])
        metrics.warmup_requests.inc(len(chosen))
        log.info("warmup: prefilled %d prompt(s) before the staggered wave", len(chosen))
    return len(chosen)


def _compile_only(engine: Any, params: SamplingParams) -> ValueError | None:
    """Compiles a skipped request's grammar (worker thread): its first user then finds it
    compiled, the one thing a request on a warm path with a cached prompt still warms.
    Returns the refusal, as building the request would have."""
    backend = getattr(engine, "grammar_backend", None)
    if params.structured is None or backend is None:
        return None
    try:
        backend.compile(params.structured)
    except ValueError as e:  # InvalidGrammar is a RequestRejected, a ValueError
        return e
    return None


async def run_warmup(aengine: Any, plan: WarmupPlan, metrics: Any, state: WarmupState | None = None) -> WarmupReport:
    """Runs the plan on `aengine` (started, phase "warming"); returns what was warmed.
    `state` is what earlier warmups of this process warmed (updated here)."""
    state = WarmupState() if state is None else state
    engine = aengine.engine
    tok = engine.tokenizer
    rendering = engine_tool_rendering(engine)
    began = time.monotonic()
    report = WarmupReport({})
    for note in plan.notes:
        log.info("warmup plan: %s", note)

    # 1. Pins: prefill each prefix (one batch), then pin what got cached. A prefix already
    # cached whole (restored from a snapshot) is pinned as it is, with no request.
    # Chat templates and tokenizing run in a worker thread: the probes answer meanwhile.
    pins = await asyncio.to_thread(lambda: [(p, pin_ids(tok, p, rendering)) for p in plan.pins])
    ps = engine.pool.page_size
    have = await aengine.run_in_engine(lambda: [cached_tokens(engine, ids) for _, ids in pins])
    restored = [bool(ids) and h >= len(ids) - len(ids) % ps for (_, ids), h in zip(pins, have)]
    finals = await _run_batch(
        aengine, [(p.template, ids, SamplingParams(max_tokens=1, temperature=0))
                  for (p, ids), warm in zip(pins, restored) if ids and not warm]
    )
    finals_iter = iter(finals)
    for (pin, ids), warm in zip(pins, restored):
        rep = report.for_template(pin.template)
        if warm:
            out = None
        else:
            out = next(finals_iter) if ids else ValueError("empty prefix")
            report.requests += 1
            metrics.warmup_requests.inc()
        if isinstance(out, ValueError):
            rep.refused += 1
            log.warning("warmup %s: cannot prefill the %s prefix to pin: %s", pin.template, pin.kind, out)
            continue
        pinned = await aengine.run_in_engine(engine.pin_prefix, ids)
        if pinned == 0:
            log.warning("warmup %s: the %s prefix (%d tokens) is shorter than a page or was not "
                        "cached: nothing pinned", pin.template, pin.kind, len(ids))
            continue
        rep.pins += 1
        rep.pinned_tokens += pinned

    # 2. Waves: the ladder reaches the batch sizes not reached yet (all of it runs); any
    # other wave skips what would warm nothing new (see _already_warm), compiling its grammar.
    salt = 0
    for wave in plan.waves:
        salts = range(salt + 1, salt + 1 + len(wave.requests))
        salt += len(wave.requests)
        items = await asyncio.to_thread(
            lambda w=wave, ss=salts: [
                (r.template, request_ids(tok, r, s, rendering), request_params(r, rendering), r)
                for r, s in zip(w.requests, ss)
            ]
        )
        skip = await _already_warm(aengine, items, state.paths, wave.ladder)
        skipped = [it for it, sk in zip(items, skip) if sk]
        refusals = await asyncio.to_thread(lambda sk=skipped: [_compile_only(engine, it[2]) for it in sk])
        for (_, _, _, req), refused in zip(skipped, refusals):
            rep = report.for_template(req.template)
            rep.skipped += 1
            if refused is not None:
                rep.refused += 1
                log.warning("warmup %s: the grammar of a %s request was refused: %s", req.template, req.kind, refused)
            else:
                rep.add_grammars(req)
        items = [it for it, sk in zip(items, skip) if not sk]
        if wave.ladder and items:
            if len(items) > 1:  # one request alone is admitted alone whatever it computes
                report.requests += await _prime(aengine, items, metrics)
            state.levels.update(wave.batch_sizes)
        outs = await _run_batch(aengine, [it[:3] for it in items])
        for (_, ids, _, req), out in zip(items, outs):
            rep = report.for_template(req.template)
            report.requests += 1
            metrics.warmup_requests.inc()
            if isinstance(out, ValueError):
                rep.refused += 1
                log.warning("warmup %s: a %s request (%d prompt tokens) was refused: %s",
                            req.template, req.kind, len(ids), out)
                continue
            rep.requests += 1
            rep.kinds[req.kind] += 1
            rep.concurrency.update(wave.batch_sizes)
            rep.add_grammars(req)
            rep.prompt_tokens += len(ids)
            rep.cached_tokens += int(out.cached_tokens or 0) if out is not None else 0

    report.seconds = time.monotonic() - began
    metrics.warmup_seconds.inc(report.seconds)  # the built-in warmup and the templates together
    for rep in report.templates.values():
        log.info("%s", rep.line())
    log.info("warmup: %d request(s) from %d template(s) in %.2fs", report.requests,
             len(report.templates), report.seconds)
    return report
