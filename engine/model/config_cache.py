"""A model's config and tokenizer class kept in the weight cache, so a restart reads them
without transformers' model classes.

`AutoConfig.from_pretrained` imports the model family's config module, and in transformers 5
every one of them imports `transformers.utils.type_validators`, which pulls in
`core_model_loading`, `torch.distributed.tensor`, sympy and accelerate: ~40% of the `load`
step on a 2-core CPU, for a handful of numbers. `AutoTokenizer` loads that config again.

So the first load of a model directory (a hub download, a converted GGUF entry) keeps, in
`<weight cache>/configs/`, the config as a complete dict and the tokenizer class transformers
chose. Later loads rebuild the config as a plain `PreTrainedConfig` (base class: light) and
call that tokenizer class directly: what AutoTokenizer ends up calling. It is kept only when
it is equivalent for the engine: everything the engine derives from a config (engine/model/
spec.py's ModelSpec, the rope settings, the stop ids, the architectures) comes out the same
from both. It is valid while config.json, the tokenizer's files, the transformers version and
this format stay the same; anything else, or anything unreadable, loads as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from preheat.engine.model.weights_id import write_atomically

log = logging.getLogger(__name__)

FORMAT = 1
# The files whose change may change the config or the tokenizer class.
WATCHED = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
           "generation_config.json", "chat_template.jinja")


def sidecar_path(model_dir: Path, cache_root: Path) -> Path:
    name = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:32]
    return cache_root / "configs" / f"{name}.json"


def signature(model_dir: Path) -> list[list]:
    import transformers

    out: list[list] = [["transformers", transformers.__version__], ["format", FORMAT]]
    for name in WATCHED:
        f = Path(model_dir) / name
        if f.is_file():
            st = f.stat()
            out.append([name, st.st_size, st.st_mtime_ns])
    return out


def light_config(data: dict[str, Any], aliases: dict[str, str] | None = None) -> Any:
    """A `PreTrainedConfig` holding every field of `data` (a config's `to_dict()`), its
    model_type included (as an instance attribute, where the engine reads it), and the
    family's `attribute_map` aliases (Qwen3-MoE's `num_experts` is `num_local_experts`)."""
    from transformers.configuration_utils import PreTrainedConfig

    config = PreTrainedConfig(**data)
    config.model_type = data.get("model_type", "")
    for alias, name in (aliases or {}).items():
        if name in config.__dict__ and alias not in config.__dict__:
            config.__dict__[alias] = config.__dict__[name]
    return config


def derived(config: Any) -> tuple:
    """Everything the engine derives from a config (raises for a model it refuses)."""
    from preheat.engine.model.rope import rope_parameters
    from preheat.engine.model.spec import ModelSpec

    return (ModelSpec.from_hf_config(config), rope_parameters(config), getattr(config, "eos_token_id", None),
            getattr(config, "architectures", None), getattr(config, "model_type", None))


_PROBE = "Hello, world! <|im_start|>user\n42 ünïcode\t tabs"


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers are the same for the engine (and for snapshot fingerprints:
    engine/kv/snapshot.py tokenizer_hash reads the vocabulary, the special tokens and the
    chat template)."""
    return (type(a) is type(b) and a.get_vocab() == b.get_vocab()
            and a.special_tokens_map == b.special_tokens_map
            and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
            and a.encode(_PROBE) == b.encode(_PROBE)
            and a.encode(_PROBE, add_special_tokens=False) == b.encode(_PROBE, add_special_tokens=False))


def read(model_dir: Path, cache_root: Path | None) -> tuple[Any, type] | None:
    """(config, tokenizer class) kept for `model_dir`, or None when there is none valid."""
    if cache_root is None:
        return None
    try:
        data = json.loads(sidecar_path(model_dir, cache_root).read_text())
        if data.get("signature") != signature(model_dir):
            return None
        import transformers

        tokenizer_class = getattr(transformers, data["tokenizer_class"], None)
        if not isinstance(tokenizer_class, type):
            return None
        return light_config(data["config"], data.get("aliases")), tokenizer_class
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def keep(model_dir: Path, cache_root: Path | None, config: Any, tokenizer: Any) -> bool:
    """Keeps `config` (AutoConfig's) and the tokenizer's class for the next load, when the
    light config is equivalent for the engine and the class is transformers' own. Never
    raises: a cache that cannot be written only means the next start loads as this one."""
    if cache_root is None:
        return False
    try:
        import transformers

        name = type(tokenizer).__name__
        data = config.to_dict()
        data["model_type"] = getattr(config, "model_type", data.get("model_type", ""))
        if getattr(transformers, name, None) is not type(tokenizer):
            return False  # a tokenizer from remote code or elsewhere: not ours to call
        aliases = {str(k): str(v) for k, v in (getattr(type(config), "attribute_map", None) or {}).items()}
        if derived(light_config(json.loads(json.dumps(data)), aliases)) != derived(config):
            return False
        if not same_tokenizer(type(tokenizer).from_pretrained(model_dir), tokenizer):
            return False
        text = json.dumps({"signature": signature(model_dir), "tokenizer_class": name, "config": data,
                           "aliases": aliases})
        return write_atomically(sidecar_path(model_dir, cache_root), text)
    except Exception as e:  # a config our derivations refuse, a value JSON cannot hold, ...
        log.debug("config cache: not kept for %s: %s: %s", model_dir, type(e).__name__, e)
        return False
