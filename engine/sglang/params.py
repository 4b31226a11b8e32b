"""From an SGLang `/generate` request to Preheat's terms: pure functions, no I/O.

`plan_generate` checks what the pydantic model cannot (fields Preheat cannot honour, the
batch's shape) and expands the request into one `PromptPlan` per engine sequence, in
SGLang's order (prompt-major, then its n samples). `sampling_params` maps SGLang's sampling
names onto Preheat's `SamplingParams`. A field is either honoured or refused with a 400 that
names it; nothing is dropped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from preheat.engine.request.api_errors import APIError
from preheat.engine.request.limits import MAX_SEQUENCES_PER_REQUEST
from preheat.engine.request.sampling_params import SamplingParams, StructuredOutput
from preheat.engine.sglang.protocol import GenerateRequest, SGLangSamplingParams

# SGLang fields Preheat does not implement, with the value that asks for nothing (None,
# false, empty and these are all accepted, as SGLang's own defaults). Any other value is a 400.
_TOP_LEVEL_NEUTRAL: dict[str, Any] = {
    "log_metrics": True,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "use_audio_in_video": False,
    "background": False,
    "require_reasoning": False,
    "return_sampling_mask": False,
    "return_prompt_token_ids": False,
}
_SAMPLING_NEUTRAL: dict[str, Any] = {
    "beam_width": 1,
    "min_new_tokens": 0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}
_WHY: dict[str, str] = {
    "image_data": "Preheat serves text-only models",
    "video_data": "Preheat serves text-only models",
    "audio_data": "Preheat serves text-only models",
    "input_embeds": "send text or input_ids",
    "lora_path": "Preheat serves no LoRA adapters",
    "session_params": "sessions are not supported; send the whole prompt (the prefix cache reuses it)",
    "ebnf": "use regex or json_schema",
    "structural_tag": "use regex or json_schema",
    "min_new_tokens": "only 0 is supported",
    "stop_regex": "use stop strings",
    "skip_special_tokens": "special tokens are always skipped",
    "spaces_between_special_tokens": "special tokens are always skipped",
    "stream_interval": "a stream carries every step's tokens",
}


@dataclass(frozen=True)
class LogprobAsk:
    """What one sequence wants back in meta_info's logprob fields."""

    top: int  # top_logprobs_num
    start: int  # logprob_start_len; -1: output tokens only
    with_text: bool  # return_text_in_logprobs


@dataclass(frozen=True)
class PromptPlan:
    prompt_index: int  # which prompt of the request
    prompt: str | list[int]
    params: SGLangSamplingParams
    rid: str | None  # the caller's id for this output, if it gave one
    logprobs: LogprobAsk | None  # None: return_logprob was not asked


@dataclass(frozen=True)
class GeneratePlan:
    single: bool  # answer one object, not a list
    prompts: list[PromptPlan]  # one per engine sequence, SGLang's output order
    n: int
    input_field: str  # "text" or "input_ids": what a prompt refusal names


_NO_DEFAULT = object()


def _neutral(value: Any, default: Any = _NO_DEFAULT) -> bool:
    """Whether a value asks for nothing: None, the field's SGLang default where it has one
    listed, else false or empty."""
    if value is None:
        return True
    if default is not _NO_DEFAULT:
        return value == default and type(value) is type(default)
    return value is False or (isinstance(value, (list, dict, str)) and not value)


def _refuse(name: str, why: str | None = None) -> APIError:
    reason = why or _WHY.get(name.split(".")[-1]) or "Preheat does not implement this SGLang field"
    return APIError(400, f"{name} is not supported by this server: {reason}", param=name,
                    code="unsupported_parameter")


def check_supported(req: GenerateRequest) -> None:
    """Refuses, by name, every field whose value asks for something Preheat cannot do."""
    for name, value in (req.model_extra or {}).items():
        if not _neutral(value, _TOP_LEVEL_NEUTRAL.get(name, _NO_DEFAULT)):
            raise _refuse(name)
    params = req.sampling_params
    for i, sp in enumerate(params if isinstance(params, list) else [params] if params else []):
        where = f"sampling_params.{i}" if isinstance(params, list) else "sampling_params"
        for name, value in (sp.model_extra or {}).items():
            if not _neutral(value, _SAMPLING_NEUTRAL.get(name, _NO_DEFAULT)):
                raise _refuse(f"{where}.{name}")
        for name in ("min_new_tokens", "stop_regex", "skip_special_tokens", "spaces_between_special_tokens"):
            if not _neutral(getattr(sp, name), _SAMPLING_NEUTRAL.get(name, _NO_DEFAULT)):
                raise _refuse(f"{where}.{name}")
        if sp.regex and sp.json_schema:
            raise APIError(400, f"{where}: give either regex or json_schema, not both",
                           param=f"{where}.regex", code="invalid_value")


def _per_prompt(value: Any, i: int, count: int, name: str) -> Any:
    """A field given once for the batch or once per prompt (SGLang's rule)."""
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise APIError(400, f"{name}: {len(value)} values for {count} prompts", param=name,
                       code="invalid_value")
    return value[i]


def plan_generate(req: GenerateRequest) -> GeneratePlan:
    check_supported(req)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of text or input_ids", param="text", code="invalid_value")
    if req.text is not None:
        field, single = "text", isinstance(req.text, str)
        prompts: list[Any] = [req.text] if single else list(req.text)
    else:
        ids = req.input_ids or []
        field = "input_ids"
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else list(ids)
    if not prompts or any(not p for p in prompts):
        raise APIError(400, f"{field} must not be empty", param=field, code="invalid_value")
    count = len(prompts)
    sps = [_per_prompt(req.sampling_params, i, count, "sampling_params") or SGLangSamplingParams()
           for i in range(count)]
    ns = {sp.n or 1 for sp in sps}
    if len(ns) > 1:
        raise APIError(400, "sampling_params.n must be the same for every prompt of a batch",
                       param="sampling_params.n", code="invalid_value")
    n = ns.pop()
    if count * n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(400, f"sampling_params.n: {count} prompts x n={n} is {count * n} sequences; one "
                       f"request may ask for at most {MAX_SEQUENCES_PER_REQUEST}",
                       param="sampling_params.n", code="invalid_value")
    rids = req.rid
    if isinstance(rids, list) and len(rids) != count:
        raise APIError(400, f"rid: {len(rids)} ids for {count} prompts", param="rid", code="invalid_value")
    plans: list[PromptPlan] = []
    for i, prompt in enumerate(prompts):
        ask = None
        if _per_prompt(req.return_logprob, i, count, "return_logprob"):
            start = _per_prompt(req.logprob_start_len, i, count, "logprob_start_len")
            ask = LogprobAsk(
                top=_per_prompt(req.top_logprobs_num, i, count, "top_logprobs_num") or 0,
                start=-1 if start is None else start,
                with_text=req.return_text_in_logprobs,
            )
            if ask.start < -1:
                raise APIError(400, "logprob_start_len must be -1 (output tokens only) or a prompt "
                               "position", param="logprob_start_len", code="invalid_value")
        base = rids[i] if isinstance(rids, list) else rids if count == 1 or rids is None else f"{rids}-{i}"
        for j in range(n):
            plans.append(PromptPlan(i, prompt, sps[i], base if n == 1 or base is None else f"{base}-{j}", ask))
    return GeneratePlan(single and n == 1, plans, n, field)


def sampling_params(sp: SGLangSamplingParams, ask: LogprobAsk | None, sample: int) -> SamplingParams:
    """SGLang's sampling fields as Preheat's. Greedy is temperature 0 in both; top_k -1 and 0
    are both "off"; max_new_tokens None runs to the context length, 0 computes the prompt
    only. The n samples of one seed use seed, seed + 1, ... so they differ yet repeat."""
    structured = None
    if sp.regex:
        structured = StructuredOutput("regex", sp.regex)
    elif sp.json_schema:
        schema = sp.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise APIError(400, f"sampling_params.json_schema is not valid JSON: {e.msg}",
                               param="sampling_params.json_schema", code="invalid_value") from None
        structured = StructuredOutput("json_schema", schema)
    prompt_only = sp.max_new_tokens == 0
    logit_bias = {int(k): v for k, v in sp.logit_bias.items()} if sp.logit_bias else None
    if logit_bias is not None and any(k < 0 for k in logit_bias):
        raise APIError(400, "sampling_params.logit_bias: keys must be token ids",
                       param="sampling_params.logit_bias", code="invalid_value")
    return SamplingParams(
        max_tokens=None if prompt_only else sp.max_new_tokens,
        temperature=1.0 if sp.temperature is None else sp.temperature,
        top_p=1.0 if sp.top_p is None else sp.top_p,
        top_k=-1 if sp.top_k in (None, 0, -1) else sp.top_k,
        min_p=sp.min_p or 0.0,
        repetition_penalty=1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty or 0.0,
        presence_penalty=sp.presence_penalty or 0.0,
        seed=None if sp.sampling_seed is None else sp.sampling_seed + sample,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=bool(sp.ignore_eos),
        include_stop_str_in_output=bool(sp.no_stop_trim),
        logprobs=None if ask is None else ask.top,
        structured=None if prompt_only else structured,
        logit_bias=logit_bias,
        prompt_only=prompt_only,
        prompt_logprobs=None if ask is None or ask.start < 0 else ask.top,
        prompt_logprobs_start=0 if ask is None or ask.start < 0 else ask.start,
    )
