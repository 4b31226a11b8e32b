"""What an engine computes from its tokenizer alone, kept in the weight cache beside the
model's config (engine/model/config_cache.py), so a restart reads it instead.

Two facts, each ~0.1 s of Python holding the GIL at every start on a small CPU (issue 27:
restart to ready): the tokenizer's hash, which snapshot fingerprints carry
(engine/kv/snapshot.py `tokenizer_hash`: the sorted vocabulary, special tokens and chat
template), and xgrammar's tokenizer info for the grammar backend (its vocabulary type
detection walks the whole vocabulary), kept as xgrammar's own serialization.

Valid under the config cache's signature (the tokenizer's files by size and modification
time, transformers' version, the format), plus xgrammar's version and the model's vocabulary
size the info was built for; anything else, or anything unreadable, is computed again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from preheat.engine.model.config_cache import sidecar_path
from preheat.engine.model.config_cache import signature as config_signature
from preheat.engine.model.weights_id import write_atomically

log = logging.getLogger(__name__)

FORMAT = 1


@dataclass(frozen=True)
class TokenizerFacts:
    tokenizer_hash: str
    grammar_info: str | None  # xgrammar TokenizerInfo.serialize_json(); None without xgrammar


def path(model_dir: Path, cache_root: Path) -> Path:
    """Beside the model's kept config: `<name>.tokenizer.json` next to `<name>.json`."""
    return sidecar_path(model_dir, cache_root).with_suffix(".tokenizer.json")


def signature(model_dir: Path, vocab_size: int) -> list[list]:
    try:
        xgrammar = metadata.version("xgrammar")
    except metadata.PackageNotFoundError:
        xgrammar = None
    return [*config_signature(model_dir), ["tokenizer-facts", FORMAT], ["xgrammar", xgrammar],
            ["vocab_size", int(vocab_size)]]


def read(model_dir: Path, cache_root: Path, vocab_size: int) -> TokenizerFacts | None:
    """The facts kept for `model_dir`'s tokenizer, or None when there are none valid."""
    try:
        data = json.loads(path(model_dir, cache_root).read_text())
        if data.get("signature") != signature(model_dir, vocab_size):
            return None
        grammar_info = data["grammar_info"]
        if not isinstance(data["tokenizer_hash"], str) or not isinstance(grammar_info, (str, type(None))):
            return None
        return TokenizerFacts(data["tokenizer_hash"], grammar_info)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep(model_dir: Path, cache_root: Path, vocab_size: int, facts: TokenizerFacts) -> bool:
    """Keeps the facts for the next start. Never raises: a cache that cannot be written only
    means the next start computes them again."""
    try:
        text = json.dumps({"signature": signature(model_dir, vocab_size), "tokenizer_hash": facts.tokenizer_hash,
                           "grammar_info": facts.grammar_info})  # fmt: skip
    except (OSError, ValueError, TypeError) as e:
        log.debug("tokenizer facts: not kept for %s: %s", model_dir, e)
        return False
    return write_atomically(path(model_dir, cache_root), text)
