"""The config kept in the weight cache (engine/model/config_cache.py): a restart reads a model's
config without transformers' model classes, and it must come out the same for the engine,
for every family the engine serves; anything that changed loads as before."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoConfig, AutoTokenizer

from preheat.engine.model import config_cache
from preheat.engine.model.loader import _config_and_tokenizer

FAMILIES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_mixtral_dir",
            "tiny_mistral_dir"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_kept_config_derives_what_autoconfig_does_for_every_family(family, request, tmp_path):
    model_dir = request.getfixturevalue(family)
    full, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert config_cache.keep(model_dir, tmp_path, full, tokenizer)
    light, tokenizer_class = config_cache.read(model_dir, tmp_path)
    assert type(light).__name__ == "PreTrainedConfig"  # not the family's module
    assert config_cache.derived(light) == config_cache.derived(full)
    assert tokenizer_class is type(tokenizer)
    assert config_cache.same_tokenizer(tokenizer_class.from_pretrained(model_dir), tokenizer)


def test_the_loader_keeps_it_on_the_first_load_and_reads_it_on_the_next(tiny_llama_dir, tmp_path):
    first, tok_a = _config_and_tokenizer(tiny_llama_dir, tmp_path)
    assert type(first).__name__ == "LlamaConfig"
    assert config_cache.sidecar_path(tiny_llama_dir, tmp_path).is_file()
    second, tok_b = _config_and_tokenizer(tiny_llama_dir, tmp_path)
    assert type(second).__name__ == "PreTrainedConfig"
    assert config_cache.derived(second) == config_cache.derived(first)
    assert config_cache.same_tokenizer(tok_a, tok_b)
    assert type(_config_and_tokenizer(tiny_llama_dir, None)[0]).__name__ == "LlamaConfig"  # no cache: as before


def test_a_changed_config_json_or_transformers_version_is_loaded_again(tiny_llama_dir, tmp_path_factory, tmp_path):
    model_dir = tmp_path_factory.mktemp("copy")
    for f in tiny_llama_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    full, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert config_cache.keep(model_dir, tmp_path, full, tokenizer)
    assert config_cache.read(model_dir, tmp_path) is not None
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (model_dir / "config.json").write_text(json.dumps(cfg))
    os.utime(model_dir / "config.json", ns=(1, 1))  # a different mtime whatever the clock's resolution
    assert config_cache.read(model_dir, tmp_path) is None
    assert config_cache.keep(model_dir, tmp_path, AutoConfig.from_pretrained(model_dir), tokenizer)
    place = config_cache.sidecar_path(model_dir, tmp_path)
    data = json.loads(place.read_text())
    data["signature"][0] = ["transformers", "0.0.1"]
    place.write_text(json.dumps(data))
    assert config_cache.read(model_dir, tmp_path) is None


def test_nothing_is_kept_when_the_light_config_would_differ_or_the_tokenizer_is_not_transformers(
        tiny_llama_dir, tmp_path):
    full, tokenizer = AutoConfig.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)

    class Derived(type(full)):
        """A config class computing a field in a property: to_dict() does not hold it."""

        @property
        def num_key_value_heads(self):
            return 1

        @num_key_value_heads.setter
        def num_key_value_heads(self, value):
            pass

    odd = Derived(**{k: v for k, v in full.to_dict().items() if k != "num_key_value_heads"})
    assert config_cache.derived(odd) != config_cache.derived(config_cache.light_config(odd.to_dict()))
    assert not config_cache.keep(tiny_llama_dir, tmp_path, odd, tokenizer)

    class Remote(type(tokenizer)):
        pass

    assert not config_cache.keep(tiny_llama_dir, tmp_path, full, Remote.from_pretrained(tiny_llama_dir))
    assert not config_cache.sidecar_path(tiny_llama_dir, tmp_path).exists()
    assert config_cache.read(tiny_llama_dir, tmp_path) is None
