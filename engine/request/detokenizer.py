"""Incremental detokenization and stop strings.

Decoding the whole output every step is quadratic; instead only a short window of recent
tokens is decoded (the vLLM prefix/read-offset method), which also holds back text that
ends in an incomplete UTF-8 sequence. Text that could still turn into a stop string is held
back from the stream until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def plain_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`,
    or the Rust tokenizer's own decode where that is exactly what it runs (a transformers
    fast tokenizer whose `decode` and `_decode` are the library's): the wrapper's argument
    conversion cost twice the decode itself, two calls a token of every stream."""
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is PreTrainedTokenizerFast._decode
        and callable(getattr(backend, "decode", None))
    ):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self._decode = plain_decoder(tokenizer)
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Appends a token; sets `stopped` when a stop string appears (text is cut there)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return
        before = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if self.stop:
            window_start = max(0, before - self.holdback)
            hits = [(self.text.find(s, window_start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, s = min(hits)
                self.text = self.text[: index + (len(s) if self.include_stop else 0)]
                self.stopped = True

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out, minus what a stop string could still claim."""
        end = len(self.text) if (finished or self.stopped) else max(self.emitted, len(self.text) - self.holdback)
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk
