"""The seam between the serving layer and the engine: everything engine/api/, engine/sglang/
and engine/serve/server.py may use of it, as Protocols.

The serving layer never holds an `Engine` or an `AsyncEngine` by its class: it holds an
`EngineClient` (what engine/async_engine.py's AsyncEngine offers: admission, the streams of
outputs, aborts, calls on the step thread, the readiness state and the metrics) and, once a
model is loaded, reaches the engine's read-only facts and its thread-safe request building
through `EngineClient.engine`, a `ServedEngine` (what engine/engine.py's Engine offers to
other threads). So a reader sees in one file what the HTTP layer depends on, a type checker
follows a request from the route to the engine, and a test double (tests/server/fake_engine.py)
is anything with these members; nothing here is checked at run time. A type checker
checks that AsyncEngine is an EngineClient (engine/serve/server_main.py hands one to
create_app) and so that Engine is a ServedEngine (AsyncEngine.engine is one);
tests/server/test_engine_client.py checks the same without one.

`Tokenizer` is the part of a Hugging Face tokenizer the serving layer calls.

It lives at the engine's top level, beside async_engine.py that implements it: it names the
engine's own types (EngineConfig, EngineStats, the KV pool, Metrics, ModelSpec) for a type
checker only, so the serving folders depend on this one module instead of on those parts.
"""

from __future__ import annotations

import collections.abc
import concurrent.futures
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from preheat.engine.config import EngineConfig
    from preheat.engine.engine import EngineStats
    from preheat.engine.kv.cache_manager import KVCacheManager
    from preheat.engine.kv.pool import KVPool
    from preheat.engine.metrics import Metrics
    from preheat.engine.model.spec import ModelSpec
    from preheat.engine.request.sampling_params import SamplingParams
    from preheat.engine.request.sequence import RequestOutput, Sequence

T = TypeVar("T")


class Tokenizer(Protocol):
    """The calls the serving layer makes on a transformers tokenizer (its chat template is
    always rendered to text, `tokenize=False`, then encoded without special tokens)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True) -> str: ...

    def get_chat_template(self, chat_template: str | None = None,
                          tools: list[dict[str, Any]] | None = None) -> str: ...


class ServedEngine(Protocol):
    """A loaded engine as the serving layer sees it: facts about the model, and the calls
    that are safe from a worker thread (validating and building sequences, the request's
    prompt-token budget, the stats). `kv` and `pool` are read only by functions the serving
    layer runs on the step thread (`EngineClient.run_in_engine`: SGLang's /flush_cache)."""

    config: EngineConfig
    tokenizer: Tokenizer
    model_config: ModelSpec
    hf_config: PretrainedConfig
    max_model_len: int
    served_model_name: str
    kv: KVCacheManager
    pool: KVPool

    def check_request_budget(self, prompt_tokens: int, param: str = "prompt") -> None: ...

    def build_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> Sequence: ...

    def stats(self) -> EngineStats: ...


class OutputStream(Protocol):
    """One request's outputs (engine/async_engine.py RequestStream): iterate once; close()
    before the end aborts the request."""

    request_id: str
    finished: bool

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    """What the serving layer may do with the engine (engine/async_engine.py AsyncEngine).

    Admission raises EngineNotReady / EngineDead (engine/async_engine.py) and the engine's
    typed refusals (engine/request/errors.py); the serving layer maps them to HTTP."""

    metrics: Metrics
    error: BaseException | None  # set when the step loop died: the process must restart
    phase_detail: Callable[[], dict[str, Any]] | None  # what /ready adds in this phase
    startup_steps: dict[str, float]  # seconds each finished start-up step took

    @property
    def engine(self) -> ServedEngine | None:
        """The loaded engine; None while the model loads."""
        ...

    @property
    def phase(self) -> str: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    def new_request_id(self, prefix: str) -> str: ...

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
               internal: bool = False) -> OutputStream: ...

    def submit_sequences(self, seqs: list[Sequence], *,
                         internal: bool = False) -> collections.abc.Sequence[OutputStream]: ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                 internal: bool = False) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def call_in_engine(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]: ...

    async def run_in_engine(self, fn: Callable[..., T], *args: Any) -> T: ...
