"""An OpenAI request's sampling fields as the engine's SamplingParams (pure).

`request_structured` is the constraint the request itself asks for (response_format or
SGLang's `regex`); tool calling may replace or join it (chat_tools.py) before
`sampling_params` builds each choice's settings.
"""

from __future__ import annotations

from preheat.engine.api.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from preheat.engine.request.api_errors import APIError
from preheat.engine.request.sampling_params import SamplingParams, StructuredOutput


def request_structured(req: SamplingFields) -> StructuredOutput | None:
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


def sampling_params(req: ChatCompletionRequest | CompletionRequest, choice: int,
                    structured: StructuredOutput | None) -> SamplingParams:
    """Choice `choice`'s settings (raises RequestRejected for a value the engine refuses)."""
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return SamplingParams(
        # None: up to the context length (the engine refuses a prompt that leaves no room)
        max_tokens=req.requested_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or -1,  # None and 0 both mean off
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
