"""SGLang's native `/generate` on Preheat's engine: prompts in, SGLang's answers out.

The plan (engine/sglang/params.py) says what to run; this file tokenizes, builds and queues
the sequences (off the event loop, with the same refusals, budget and backpressure as the
OpenAI routes: OpenAIServing.ready_engine, engine/api/refusals.py and streams.py), and shapes
what comes back as SGLang does: `{"text", "output_ids", "meta_info"}` per sequence, one
object for a single prompt and a list for a batch; a stream sends the cumulative text of a
sequence in each event (the frontend slices off what it has seen), with `index` in a batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from preheat.engine.api.openai_serving import OpenAIServing
from preheat.engine.api.refusals import STREAM_ERRORS, as_api_error, stream_error
from preheat.engine.api.streams import DONE, Submitted, collect, merge, sse
from preheat.engine.engine_client import ServedEngine
from preheat.engine.request.api_errors import APIError
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import RequestOutput, Sequence
from preheat.engine.sglang.params import GeneratePlan, PromptPlan, plan_generate, sampling_params
from preheat.engine.sglang.protocol import GenerateRequest


@dataclass
class _Seq:
    """One engine sequence behind one SGLang output."""

    plan: PromptPlan
    prompt_ids: list[int]
    rid: str
    params: SamplingParams
    started: float


class SGLangServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai
        self.aengine = openai.aengine

    # ------------------------------------------------------------ submit

    def _build(self, engine: ServedEngine, plan: GeneratePlan) -> tuple[list[_Seq], list[Sequence]]:
        """Worker thread: tokenize, check, build every sequence (nothing queued yet)."""
        ids_of: dict[int, list[int]] = {}
        for p in plan.prompts:
            if p.prompt_index not in ids_of:
                ids_of[p.prompt_index] = (list(engine.tokenizer.encode(p.prompt)) if isinstance(p.prompt, str)
                                          else list(p.prompt))
        engine.check_request_budget(sum(len(ids_of[p.prompt_index]) for p in plan.prompts), "prompt")
        seqs: list[_Seq] = []
        built: list[Sequence] = []
        now = time.monotonic()
        for k, p in enumerate(plan.prompts):
            ids = ids_of[p.prompt_index]
            if p.logprobs is not None and p.logprobs.start > len(ids):
                raise APIError(400, f"logprob_start_len={p.logprobs.start} is past the prompt's "
                               f"{len(ids)} tokens", param="logprob_start_len", code="invalid_value")
            params = sampling_params(p.params, p.logprobs, k % plan.n)
            rid = self.aengine.new_request_id("generate")
            built.append(engine.build_sequence(ids, params, rid))
            seqs.append(_Seq(p, ids, p.rid or rid, params, now))
        return seqs, built

    async def generate(self, req: GenerateRequest) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[str]:
        engine = self.openai.ready_engine()
        plan = plan_generate(req)
        try:
            seqs, built = await asyncio.to_thread(self._build, engine, plan)
            streams = self.aengine.submit_sequences(built)
        except Exception as e:
            raise _rename_prompt(as_api_error(e, None), plan.input_field, plan) from None
        subs = [Submitted(i, s.prompt_ids, stream) for i, (s, stream) in enumerate(zip(seqs, streams))]
        if req.stream:
            return self._stream(engine, plan, seqs, subs)
        finals = await collect(subs)
        answers = await asyncio.to_thread(
            lambda: [self.answer(engine, s, out) for s, out in zip(seqs, finals)])
        return answers[0] if plan.single else answers

    async def _stream(self, engine: ServedEngine, plan: GeneratePlan, seqs: list[_Seq],
                      subs: list[Submitted]) -> AsyncIterator[str]:
        try:
            async for sub, out in merge(subs):
                if not (out.new_token_ids or out.finished):
                    continue
                body = self.answer(engine, seqs[sub.index], out)
                if not plan.single:
                    body["index"] = sub.index
                yield sse(body)
        except STREAM_ERRORS as e:
            yield sse(stream_error(e))
        yield DONE

    # ------------------------------------------------------------ answers

    def answer(self, engine: ServedEngine, s: _Seq, out: RequestOutput) -> dict[str, Any]:
        """One SGLang output object: what the sequence has produced so far."""
        meta: dict[str, Any] = {
            "id": s.rid,
            "finish_reason": finish_reason(engine, s, out) if out.finished else None,
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(out.token_ids or ()),
            "cached_tokens": int(out.cached_tokens or 0),
        }
        if out.finished:
            meta["e2e_latency"] = round(time.monotonic() - s.started, 6)
        ask = s.plan.logprobs
        if ask is not None:
            meta.update(logprob_fields(engine, s, out, ask.top, ask.with_text))
        return {"text": out.text, "output_ids": list(out.token_ids or ()), "meta_info": meta}


def finish_reason(engine: ServedEngine, s: _Seq, out: RequestOutput) -> dict[str, Any]:
    """SGLang's finish reasons: {"type": "stop", "matched": <token id or stop string>},
    {"type": "length", "length": <max_new_tokens>}, {"type": "abort", "message": ...}."""
    reason = out.finish_reason
    if reason == "length":
        if s.params.prompt_only:
            return {"type": "length", "length": 0}
        limit = s.params.max_tokens
        return {"type": "length", "length": len(out.token_ids or ()) if limit is None else limit}
    if reason == "stop":
        tokens = list(out.token_ids or ())
        stops = list(s.params.stop or [])
        if stops and tokens:
            text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
            hits = [(text.find(x), x) for x in stops if x in text]
            if hits:
                return {"type": "stop", "matched": min(hits)[1]}
        return {"type": "stop", "matched": tokens[-1]} if tokens else {"type": "stop"}
    return {"type": "abort", "message": out.error or "the request was aborted"}


def _entry(engine: ServedEngine, token_id: int, logprob: float | None, with_text: bool) -> list[float | int | str | None]:
    return [logprob, token_id, engine.tokenizer.decode([token_id]) if with_text else None]


def logprob_fields(engine: ServedEngine, s: _Seq, out: RequestOutput, top: int, with_text: bool) -> dict[str, Any]:
    """meta_info's logprob fields, shaped as SGLang's: [logprob, token_id, text-or-None] per
    token; the first prompt token asked for has logprob None."""
    start = s.params.prompt_logprobs_start if s.params.prompt_logprobs is not None else len(s.prompt_ids)
    prompt_lps = out.prompt_logprobs or []
    input_ids = s.prompt_ids[start:]
    fields: dict[str, Any] = {
        "input_token_logprobs": [
            _entry(engine, t, lp.logprob if lp is not None else None, with_text)
            for t, lp in zip(input_ids, prompt_lps or [None] * len(input_ids))
        ],
        "output_token_logprobs": [_entry(engine, lp.token_id, lp.logprob, with_text) for lp in out.logprobs or ()],
    }
    if top > 0:
        fields["input_top_logprobs"] = [
            None if lp is None else [_entry(engine, t, v, with_text) for t, v in lp.top] for lp in prompt_lps
        ]
        fields["output_top_logprobs"] = [
            [_entry(engine, t, v, with_text) for t, v in lp.top] for lp in out.logprobs or ()
        ]
    return fields


_SAMPLING_NAMES = {"max_tokens": "max_new_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids",
                   "logit_bias": "logit_bias", "seed": "sampling_seed"}


def _rename_prompt(err: BaseException, field: str, plan: GeneratePlan) -> BaseException:
    """The engine names parameters in OpenAI's terms; say them in the SGLang request's."""
    if not isinstance(err, APIError) or err.param is None:
        return err
    if err.param in ("prompt", "messages"):
        err.param = field
    elif err.param in ("response_format", "regex"):
        regex = any(p.params.regex for p in plan.prompts)
        err.param = "sampling_params." + ("regex" if regex else "json_schema")
    elif err.param in _SAMPLING_NAMES:
        err.param = "sampling_params." + _SAMPLING_NAMES[err.param]
    return err
