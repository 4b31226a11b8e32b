"""Turns OpenAI requests into engine requests and engine outputs into OpenAI responses.

The HTTP layer (engine/serve/) reads and validates the body; this file owns the meaning and
the order. A chat request goes through it once, top to bottom, in `chat`:

    parse    ChatTools.decide          the tool plan and the model's call format (chat_tools.py)
    render   _chat_prompt              messages (+ tools) -> prompt ids (chat_render.py)
    params   request_structured, ChatTools.structured, sampling_params (openai_params.py)
    submit   _sequences, _submit       engine sequences, queued all or none (EngineClient)
    format   _chat_whole/_chat_stream  outputs -> message / deltas (engine/tools/output.py)

A completion takes the same road without tools. The engine's typed refusals become HTTP
statuses in refusals.py; checks against the model (context length, vocabulary, grammars)
are the engine's.

Everything that scales with the input (the chat template, tokenizing, building the engine
sequences, which compiles grammars) runs in a worker thread, never on the event loop, so
/health and /ready answer whatever a request carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from preheat.engine.api.chat_tools import ChatTools
from preheat.engine.api.openai_output import chat_logprobs, completion_logprobs, usage
from preheat.engine.api.openai_params import request_structured, sampling_params
from preheat.engine.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    new_id,
    now,
)
from preheat.engine.api.refusals import STREAM_ERRORS, as_api_error, prompt_param, stream_error
from preheat.engine.api.streams import DONE, Submitted, collect, merge, sse
from preheat.engine.engine_client import EngineClient, ServedEngine
from preheat.engine.request.api_errors import APIError
from preheat.engine.request.sampling_params import StructuredOutput
from preheat.engine.request.sequence import RequestOutput, Sequence


@dataclass
class Prepared:
    """A request turned into engine sequences (in a worker thread), not yet queued."""

    prompts: list[list[int]]
    seqs: list[Sequence]  # prompts x n, choice index order
    echo: list[str]  # the prompts' text, when the request asks for an echo


class OpenAIServing:
    def __init__(self, aengine: EngineClient, model_name: str | None = None) -> None:
        self.aengine = aengine
        self._model_name = model_name

    @property
    def model_name(self) -> str:
        """--served-model-name, else the name the engine derived from the weights."""
        if self._model_name:
            return self._model_name
        return getattr(self.aengine.engine, "served_model_name", None) or "default"

    # ------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        if not model:
            raise APIError(400, "you must provide a model parameter", param="model",
                           code="missing_model")
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`", param="model", code="model_not_found")

    def ready_engine(self) -> ServedEngine:
        """The engine, when it serves requests now: else a 500 (dead) or a 503 (not ready)."""
        ae = self.aengine
        if ae.error is not None:
            raise APIError(500, f"engine failed: {ae.error}", code="engine_dead")
        if not ae.is_ready or ae.engine is None:
            raise APIError(503, f"engine is not ready (phase: {ae.phase})", code="not_ready")
        return ae.engine

    # ------------------------------------------------------------ chat

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        engine = self.ready_engine()  # not ready: 503 first, the model name is not known yet
        self.check_model(req.model)
        tools = ChatTools.decide(engine, req.tools, req.tool_choice, req.parallel_tool_calls)

        def build() -> Prepared:  # worker thread
            prompts = [self._chat_prompt(engine, req, tools)]
            _check_budget(engine, req, prompts)
            structured = tools.structured(request_structured(req))
            return Prepared(prompts, self._sequences(engine, req, prompts, structured, "chatcmpl"), [])

        prep = await self._prepare(req, build)
        subs = self._submit(req, prep)
        rid, created = new_id("chatcmpl"), now()
        if req.stream:
            return self._chat_stream(engine, req, subs, rid, created, tools)
        return await self._chat_whole(engine, req, prep, subs, rid, created, tools)

    @staticmethod
    def _chat_prompt(engine: ServedEngine, req: ChatCompletionRequest | TokenizeRequest, tools: ChatTools,
                     add_generation_prompt: bool = True) -> list[int]:
        messages = [m.as_dict() for m in req.messages or ()]
        try:
            return tools.prompt_ids(engine.tokenizer, messages, add_generation_prompt)
        except Exception as e:
            raise APIError(400, f"messages: cannot apply the chat template: {e}",
                           param="messages") from None

    async def _chat_whole(self, engine: ServedEngine, req: ChatCompletionRequest, prep: Prepared,
                          subs: list[Submitted], rid: str, created: int, tools: ChatTools) -> dict[str, Any]:
        finals = await collect(subs)

        def build_choices() -> list[dict[str, Any]]:  # logprobs decode every token: off the loop
            choices = []
            for s, out in zip(subs, finals):
                message, reason = tools.message(out.text, out.finish_reason)
                choices.append({
                    "index": s.index,
                    "message": message,
                    "logprobs": chat_logprobs(engine.tokenizer, out) if req.logprobs else None,
                    "finish_reason": reason,
                })
            return choices

        choices = await asyncio.to_thread(build_choices) if req.logprobs else build_choices()
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": choices, "usage": usage(prep.prompts, finals, req.n),
            "system_fingerprint": None,
        }

    async def _chat_stream(self, engine: ServedEngine, req: ChatCompletionRequest, subs: list[Submitted],
                           rid: str, created: int, tools: ChatTools) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                                    "created": created, "model": self.model_name,
                                    "system_fingerprint": None, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        for s in subs:
            yield chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        finals: dict[int, RequestOutput] = {}
        try:
            by_index = {s.index: tools.deltas() for s in subs}
            async for s, out in merge(subs):
                lp = chat_logprobs(engine.tokenizer, out, new_only=True) if req.logprobs else None
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
                                  "finish_reason": stream.finish_reason(out.finish_reason)}])
        except STREAM_ERRORS as e:
            yield sse(stream_error(e))
            yield DONE
            return
        if include_usage:
            ordered = [finals[s.index] for s in subs]
            yield chunk([], usage([subs[0].prompt_ids], ordered, req.n))
        yield DONE

    # ------------------------------------------------------------ completions

    async def completion(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        engine = self.ready_engine()  # not ready: 503 first, the model name is not known yet
        self.check_model(req.model)

        def build() -> Prepared:  # worker thread
            prompts = _completion_prompts(engine, req)
            _check_budget(engine, req, prompts)
            seqs = self._sequences(engine, req, prompts, request_structured(req), "cmpl")
            echo = [engine.tokenizer.decode(p) for p in prompts] if req.echo else []
            return Prepared(prompts, seqs, echo)

        prep = await self._prepare(req, build)
        subs = self._submit(req, prep)
        rid, created = new_id("cmpl"), now()
        if req.stream:
            return self._completion_stream(engine, req, subs, prep, rid, created)
        return await self._completion_whole(engine, req, subs, prep, rid, created)

    async def _completion_whole(self, engine: ServedEngine, req: CompletionRequest, subs: list[Submitted],
                                prep: Prepared, rid: str, created: int) -> dict[str, Any]:
        finals = await collect(subs)

        def build_choices() -> list[dict[str, Any]]:  # logprobs decode every token: off the loop
            choices = []
            for s, out in zip(subs, finals):
                prefix = prep.echo[s.index // req.n] if req.echo else ""
                choices.append({
                    "index": s.index, "text": prefix + out.text,
                    "logprobs": completion_logprobs(engine.tokenizer, out, len(prefix))
                    if req.logprobs is not None else None,
                    "finish_reason": out.finish_reason,
                })
            return choices

        choices = await asyncio.to_thread(build_choices) if req.logprobs is not None else build_choices()
        return {
            "id": rid, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": choices, "usage": usage(prep.prompts, finals, req.n), "system_fingerprint": None,
        }

    async def _completion_stream(self, engine: ServedEngine, req: CompletionRequest, subs: list[Submitted],
                                 prep: Prepared, rid: str, created: int
                                 ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = {s.index: 0 for s in subs}

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                    "model": self.model_name, "system_fingerprint": None,
                                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        if req.echo:
            for s in subs:
                text = prep.echo[s.index // req.n]
                offsets[s.index] = len(text)
                yield chunk([{"index": s.index, "text": text, "logprobs": None,
                              "finish_reason": None}])
        finals: dict[int, RequestOutput] = {}
        try:
            async for s, out in merge(subs):
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(engine.tokenizer, out, offsets[s.index], new_only=True)
                    offsets[s.index] += len(out.new_text)
                if out.new_text or out.finished:
                    yield chunk([{"index": s.index, "text": out.new_text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None}])
                if out.finished:
                    finals[s.index] = out
        except STREAM_ERRORS as e:
            yield sse(stream_error(e))
            yield DONE
            return
        if include_usage:
            yield chunk([], usage(prep.prompts, [finals[s.index] for s in subs], req.n))
        yield DONE

    # ------------------------------------------------------------ tokenizer

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """What the engine would see: the same template and tokenizer as a request."""
        engine = self.ready_engine()
        if req.model is not None:
            self.check_model(req.model)

        def work() -> list[int]:
            if req.messages is not None:
                return self._chat_prompt(engine, req, ChatTools.decide(engine, req.tools), req.add_generation_prompt)
            return list(engine.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens))

        ids = await asyncio.to_thread(work)
        return {"count": len(ids), "max_model_len": int(engine.max_model_len), "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        engine = self.ready_engine()
        if req.model is not None:
            self.check_model(req.model)
        vocab = int(engine.model_config.vocab_size)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: {bad[0]} is not a token id of this model (0 to {vocab - 1})",
                           param="tokens", code="invalid_value")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    # ------------------------------------------------------------ submit (chat and completions)

    def _sequences(self, engine: ServedEngine, req: ChatCompletionRequest | CompletionRequest,
                   prompts: list[list[int]], structured: StructuredOutput | None, prefix: str) -> list[Sequence]:
        """Worker thread: prompts x n engine sequences, every check the engine makes done
        (context, vocabulary, sampling values, grammar compile); nothing queued yet."""
        seqs = []
        for ids in prompts:
            for c in range(req.n):
                rid = self.aengine.new_request_id(prefix)
                seqs.append(engine.build_sequence(ids, sampling_params(req, c, structured), rid))
        return seqs

    @staticmethod
    async def _prepare(req: ChatCompletionRequest | CompletionRequest, build: Callable[[], Prepared]) -> Prepared:
        """Runs `build` off the event loop; engine refusals become OpenAI errors."""
        try:
            return await asyncio.to_thread(build)
        except Exception as e:
            raise as_api_error(e, req) from None

    def _submit(self, req: ChatCompletionRequest | CompletionRequest, prep: Prepared) -> list[Submitted]:
        """Queues all of the request's sequences, or none (a full queue is a 429)."""
        try:
            streams = self.aengine.submit_sequences(prep.seqs)
        except Exception as e:
            raise as_api_error(e, req) from None
        return [Submitted(i, prep.prompts[i // req.n], stream) for i, stream in enumerate(streams)]


# ---------------------------------------------------------------- helpers


def _completion_prompts(engine: ServedEngine, req: CompletionRequest) -> list[list[int]]:
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


def _check_budget(engine: ServedEngine, req: ChatCompletionRequest | CompletionRequest,
                  prompts: list[list[int]]) -> None:
    """--max-request-prompt-tokens over all of the request's sequences (prompts x n)."""
    engine.check_request_budget(sum(len(p) for p in prompts) * req.n, prompt_param(req))

