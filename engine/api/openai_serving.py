"""Turns OpenAI requests into engine requests and engine outputs into OpenAI responses.

The HTTP layer (server.py) reads and validates the body; this file owns the meaning:
prompt rendering, SamplingParams, n choices, streaming chunks, and the mapping of the
engine's typed refusals (RequestRejected, QueueFull, RequestFailed) to HTTP statuses.
Checks against the model (context length, vocabulary, grammars) are the engine's.

Everything that scales with the input (the chat template, tokenizing, building the engine
sequences, which compiles grammars) runs in a worker thread, never on the event loop, so
/health and /ready answer whatever a request carries.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from preheat.engine.api.chat_render import ToolRendering, engine_tool_rendering, render_chat
from preheat.engine.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    new_id,
    now,
)
from preheat.engine.async_engine import AsyncEngine, EngineDead, EngineNotReady, RequestStream
from preheat.engine.request.api_errors import APIError, error_body
from preheat.engine.request.errors import RequestFailed, RequestRejected
from preheat.engine.tools.calling import ToolPlan, plan_tools, tool_structured_output
from preheat.engine.tools.output import DeltaStream, chat_message, finish_reason


@dataclass
class Submitted:
    """One engine request behind one OpenAI choice."""

    index: int
    prompt_ids: list[int]
    stream: RequestStream


@dataclass
class Prepared:
    """A request turned into engine sequences (in a worker thread), not yet queued."""

    prompts: list[list[int]]
    seqs: list[Any]  # prompts x n, choice index order
    echo: list[str]  # the prompts' text, when the request asks for an echo


class OpenAIServing:
    def __init__(self, aengine: AsyncEngine, model_name: str | None = None) -> None:
        self.aengine = aengine
        self._model_name = model_name

    @property
    def model_name(self) -> str:
        """--served-model-name, else the name the engine derived from the weights."""
        if self._model_name:
            return self._model_name
        engine = self.aengine.engine
        return getattr(engine, "served_model_name", None) or "default"

    # ------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        if not model:
            raise APIError(400, "you must provide a model parameter", param="model",
                           code="missing_model")
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`", param="model", code="model_not_found")

    def _engine(self) -> Any:
        ae = self.aengine
        if ae.error is not None:
            raise APIError(500, f"engine failed: {ae.error}", code="engine_dead")
        if not ae.is_ready:
            raise APIError(503, f"engine is not ready (phase: {ae.phase})", code="not_ready")
        return ae.engine

    # ------------------------------------------------------------ prompts

    @staticmethod
    def tool_rendering(engine: Any) -> ToolRendering:
        """How tools reach this model's prompt and which call format it answers in."""
        return engine_tool_rendering(engine)

    def chat_prompt(self, engine: Any, req: ChatCompletionRequest | TokenizeRequest,
                    add_generation_prompt: bool = True, plan: ToolPlan | None = None) -> list[int]:
        messages = [m.as_dict() for m in req.messages or ()]
        tools = plan.tools if plan is not None else None
        try:
            text = render_chat(engine.tokenizer, messages, tools, self.tool_rendering(engine),
                               add_generation_prompt)
            # The template already wrote the special tokens.
            return list(engine.tokenizer.encode(text, add_special_tokens=False))
        except Exception as e:
            raise APIError(400, f"messages: cannot apply the chat template: {e}",
                           param="messages") from None

    def completion_prompts(self, engine: Any, req: CompletionRequest) -> list[list[int]]:
        """The prompts as token ids (the engine checks them against the vocabulary and the
        context when it builds their sequences)."""
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        out: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                try:
                    out.append(list(engine.tokenizer.encode(p)))
                except Exception as e:
                    raise APIError(400, f"prompt: cannot tokenize: {e}", param="prompt") from None
            else:
                out.append(list(p))
        return out

    # ------------------------------------------------------------ params

    def sampling_params(self, engine: Any, req: Any, choice: int, plan: ToolPlan | None = None) -> Any:
        from preheat.engine.request.sampling_params import SamplingParams, StructuredOutput

        structured = _structured(req, StructuredOutput)
        if plan is not None:
            structured = tool_structured_output(plan, self.tool_rendering(engine).fmt, structured)
        if isinstance(req, ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        return SamplingParams(
            # None: up to the context length (the engine refuses a prompt that leaves no room)
            max_tokens=req.requested_max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            # n choices from one seed must differ from each other, yet repeat exactly.
            seed=None if req.seed is None else req.seed + choice,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            structured=structured,
            logit_bias=req.token_logit_bias(),
        )

    # ------------------------------------------------------------ submit

    def build(self, engine: Any, req: Any, prompts: list[list[int]], prefix: str,
              plan: ToolPlan | None = None) -> Prepared:
        """Worker thread: prompts x n engine sequences, every check the engine makes done
        (context, vocabulary, the request's prompt-token budget, grammar compile)."""
        engine.check_request_budget(sum(len(p) for p in prompts) * req.n, _prompt_param(req))
        seqs = []
        for ids in prompts:
            for c in range(req.n):
                rid = self.aengine.new_request_id(prefix)
                seqs.append(engine.build_sequence(ids, self.sampling_params(engine, req, c, plan), rid))
        echo = [engine.tokenizer.decode(p) for p in prompts] if getattr(req, "echo", False) else []
        return Prepared(prompts, seqs, echo)

    async def prepare(self, req: Any, prompts_of: Any, prefix: str, plan: ToolPlan | None = None) -> Prepared:
        """Renders and tokenizes the prompts (`prompts_of(engine)`) and builds the sequences
        off the event loop; engine refusals become OpenAI errors."""
        engine = self._engine()
        try:
            return await asyncio.to_thread(lambda: self.build(engine, req, prompts_of(engine), prefix, plan))
        except Exception as e:
            raise _as_api_error(e, req) from None

    def submit(self, req: Any, prep: Prepared) -> list[Submitted]:
        """Queues all of the request's sequences, or none (a full queue is a 429)."""
        try:
            streams = self.aengine.submit_sequences(prep.seqs)
        except Exception as e:
            raise _as_api_error(e, req) from None
        return [Submitted(i, prep.prompts[i // req.n], stream) for i, stream in enumerate(streams)]

    # ------------------------------------------------------------ chat

    async def chat(self, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        engine = self._engine()  # not ready: 503 first, the model name is not known yet
        self.check_model(req.model)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        prep = await self.prepare(req, lambda e: [self.chat_prompt(e, req, plan=plan)], "chatcmpl", plan)
        ids = prep.prompts[0]
        subs = self.submit(req, prep)
        rid, created = new_id("chatcmpl"), now()
        fmt = self.tool_rendering(engine).fmt
        if req.stream:
            return self._chat_stream(engine, req, subs, rid, created, [DeltaStream(plan, fmt) for _ in subs])
        finals = await _collect(subs)

        def build_choices() -> list[dict]:  # logprobs decode every token: off the loop
            choices = []
            for s, out in zip(subs, finals):
                message, reason = chat_message(out.text, out.finish_reason, plan, fmt)
                choices.append({
                    "index": s.index,
                    "message": message,
                    "logprobs": _chat_logprobs(engine, out) if req.logprobs else None,
                    "finish_reason": reason,
                })
            return choices

        choices = await asyncio.to_thread(build_choices) if req.logprobs else build_choices()
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": choices, "usage": _usage([ids], finals, req.n),
            "system_fingerprint": None,
        }

    async def _chat_stream(self, engine: Any, req: ChatCompletionRequest, subs: list[Submitted],
                           rid: str, created: int, deltas: list[DeltaStream]) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                                    "created": created, "model": self.model_name,
                                    "system_fingerprint": None, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return _sse(body)

        for s in subs:
            yield chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        finals: dict[int, Any] = {}
        try:
            by_index = dict(zip((s.index for s in subs), deltas))
            async for s, out in _merge(subs):
                lp = _chat_logprobs(engine, out, new_only=True) if req.logprobs else None
                stream = by_index[s.index]
                pieces = stream.feed(out.new_text, out.finished)
                if not pieces and lp and lp["content"]:
                    pieces = [{"content": ""}]
                for delta in pieces:  # logprobs ride on the first chunk of the step
                    yield chunk([{"index": s.index, "delta": delta, "logprobs": lp,
                                  "finish_reason": None}])
                    lp = None
                if out.finished:
                    finals[s.index] = out
                    yield chunk([{"index": s.index, "delta": {}, "logprobs": None,
                                  "finish_reason": finish_reason(out.finish_reason, stream.has_calls)}])
        except (EngineDead, EngineNotReady, RequestFailed) as e:
            yield _sse(_stream_error(e))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            ordered = [finals[s.index] for s in subs]
            yield chunk([], _usage([subs[0].prompt_ids], ordered, req.n))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ completions

    # ------------------------------------------------------------ tokenizer

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """What the engine would see: the same template and tokenizer as a request."""
        engine = self._engine()
        if req.model is not None:
            self.check_model(req.model)

        def work() -> list[int]:
            if req.messages is not None:
                return self.chat_prompt(engine, req, req.add_generation_prompt, plan_tools(req.tools))
            return list(engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))

        ids = await asyncio.to_thread(work)
        return {"count": len(ids), "max_model_len": int(engine.max_model_len), "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        engine = self._engine()
        if req.model is not None:
            self.check_model(req.model)
        vocab = int(engine.model_config.vocab_size)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: {bad[0]} is not a token id of this model (0 to {vocab - 1})",
                           param="tokens", code="invalid_value")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    async def completion(self, req: CompletionRequest) -> dict | AsyncIterator[str]:
        engine = self._engine()  # not ready: 503 first, the model name is not known yet
        self.check_model(req.model)
        prep = await self.prepare(req, lambda e: self.completion_prompts(e, req), "cmpl")
        prompts = prep.prompts
        subs = self.submit(req, prep)
        rid, created = new_id("cmpl"), now()
        if req.stream:
            return self._completion_stream(engine, req, subs, prep, rid, created)
        finals = await _collect(subs)

        def build_choices() -> list[dict]:  # logprobs decode every token: off the loop
            choices = []
            for s, out in zip(subs, finals):
                prefix = prep.echo[s.index // req.n] if req.echo else ""
                choices.append({
                    "index": s.index, "text": prefix + out.text,
                    "logprobs": _completion_logprobs(engine, out, len(prefix))
                    if req.logprobs is not None else None,
                    "finish_reason": out.finish_reason,
                })
            return choices

        choices = await asyncio.to_thread(build_choices) if req.logprobs is not None else build_choices()
        return {
            "id": rid, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": choices, "usage": _usage(prompts, finals, req.n), "system_fingerprint": None,
        }

    async def _completion_stream(self, engine: Any, req: CompletionRequest, subs: list[Submitted],
                                 prep: Prepared, rid: str, created: int
                                 ) -> AsyncIterator[str]:
        prompts = prep.prompts
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = {s.index: 0 for s in subs}

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                    "model": self.model_name, "system_fingerprint": None,
                                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return _sse(body)

        if req.echo:
            for s in subs:
                text = prep.echo[s.index // req.n]
                offsets[s.index] = len(text)
                yield chunk([{"index": s.index, "text": text, "logprobs": None,
                              "finish_reason": None}])
        finals: dict[int, Any] = {}
        try:
            async for s, out in _merge(subs):
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(engine, out, offsets[s.index], new_only=True)
                    offsets[s.index] += len(out.new_text)
                if out.new_text or out.finished:
                    yield chunk([{"index": s.index, "text": out.new_text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None}])
                if out.finished:
                    finals[s.index] = out
        except (EngineDead, EngineNotReady, RequestFailed) as e:
            yield _sse(_stream_error(e))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield chunk([], _usage(prompts, [finals[s.index] for s in subs], req.n))
        yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- helpers


def _structured(req: SamplingFields, StructuredOutput: type) -> Any:
    rf = getattr(req, "response_format", None)
    kinds = []
    if rf is not None and rf.type != "text":
        kinds.append("response_format")
    if req.regex is not None:
        kinds.append("regex")
    if len(kinds) > 1:
        raise APIError(400, "give either response_format or regex, not both", param="regex")
    if req.regex is not None:
        return StructuredOutput("regex", req.regex)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json_object", None)
    return StructuredOutput("json_schema", rf.json_schema.schema_)  # type: ignore[union-attr]


def _prompt_param(req: Any) -> str:
    return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"


def _grammar_param(req: Any, kind: str | None) -> str:
    """The request field that carried a refused grammar."""
    if kind == "structural_tag":
        return "tools"  # only tool calling builds structural tags
    return "regex" if getattr(req, "regex", None) is not None else "response_format"


def _as_api_error(e: BaseException, req: Any) -> BaseException:
    """The engine's typed refusals as OpenAI errors: status, code and param come from the
    exception's type and fields, never from its message."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestRejected):
        param = e.param
        if param == "prompt":
            param = _prompt_param(req)  # the engine says prompt; a chat request sent messages
        elif param is None and e.code.startswith(("invalid_grammar", "grammar_")):
            param = _grammar_param(req, getattr(e, "kind", None))
        return APIError(e.status, e.message, param=param, code=e.code, retry_after=getattr(e, "retry_after", None))
    if isinstance(e, EngineNotReady):
        return APIError(503, f"engine is not ready (phase: {e})", code="not_ready")
    if isinstance(e, EngineDead):
        return APIError(500, f"engine failed: {e}", code="engine_dead")
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), code="request_failed")
    if isinstance(e, ValueError):  # an engine without typed refusals (a test double)
        return APIError(400, str(e))
    return e


def _stream_error(e: BaseException) -> dict:
    """The error event of a stream that already answered 200."""
    if isinstance(e, RequestFailed):
        return error_body(500, str(e), code="request_failed")
    return error_body(500, f"engine failed: {e}", code="engine_dead")


async def _collect(subs: list[Submitted]) -> list[Any]:
    """Runs all choices to the end; the last output of each carries its full text."""

    async def last(s: Submitted) -> Any:
        final = None
        async for out in s.stream:
            final = out
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


async def _merge(subs: list[Submitted]) -> AsyncIterator[tuple[Submitted, Any]]:
    """Interleaves the outputs of several choices as they arrive."""
    if len(subs) == 1:
        try:
            async for out in subs[0].stream:
                yield subs[0], out
        finally:
            subs[0].stream.close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(s: Submitted) -> None:
        try:
            async for out in s.stream:
                queue.put_nowait((s, out))
        except BaseException as e:
            queue.put_nowait((s, e))
        finally:
            queue.put_nowait((s, done))

    tasks = [asyncio.ensure_future(pump(s)) for s in subs]
    left = len(subs)
    try:
        while left:
            s, item = await queue.get()
            if item is done:
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


def _usage(prompts: list[list[int]], finals: list[Any], n: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(o.token_ids or ()) for o in finals)
    # Each prompt is billed once however many choices it has; its cached part is what its
    # first choice found in the prefix cache.
    cached = sum(int(finals[i * n].cached_tokens or 0) for i in range(len(prompts)))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": min(cached, prompt_tokens)},
    }


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _token_text(engine: Any, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def _top_entry(engine: Any, token_id: int, logprob: float) -> dict:
    text = _token_text(engine, token_id)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def _new_logprobs(out: Any, new_only: bool) -> list[Any]:
    if new_only:
        return list(getattr(out, "new_logprobs", None) or [])
    return list(out.logprobs or [])


def _chat_logprobs(engine: Any, out: Any, new_only: bool = False) -> dict:
    content = []
    for lp in _new_logprobs(out, new_only):
        entry = _top_entry(engine, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_top_entry(engine, t, v) for t, v in (lp.top or [])]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(engine: Any, out: Any, offset: int, new_only: bool = False) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for lp in _new_logprobs(out, new_only):
        text = _token_text(engine, lp.token_id)
        tokens.append(text)
        token_lps.append(float(lp.logprob))
        tops.append({_token_text(engine, t): float(v) for t, v in (lp.top or [])})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
