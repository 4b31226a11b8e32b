"""EngineConfig is its sections, flat: every flag belongs to exactly one section, the flat
names (flags, PREHEAT_* variables, LLM(**kwargs)) are unchanged, and `--help` groups them."""

from __future__ import annotations

import argparse
import dataclasses

from preheat.engine.config import SECTIONS, EngineConfig, add_arguments


def test_every_field_is_in_exactly_one_section() -> None:
    owners: dict[str, list[str]] = {}
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            owners.setdefault(f.name, []).append(section.__name__)
    assert {f.name for f in dataclasses.fields(EngineConfig)} == set(owners)
    assert {name: o for name, o in owners.items() if len(o) > 1} == {}


def test_a_config_is_each_of_its_sections_and_keeps_flat_names() -> None:
    cfg = EngineConfig(max_num_seqs=3, num_speculative_tokens=2, host_cache_size=0.5)
    assert all(isinstance(cfg, section) for section in SECTIONS)
    assert (cfg.max_num_seqs, cfg.num_speculative_tokens, cfg.host_cache_size) == (3, 2, 0.5)
    assert dataclasses.replace(cfg, max_num_seqs=4).max_num_seqs == 4


def test_help_groups_the_flags_by_section() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for section in SECTIONS:
        assert groups[section.SECTION] == {f.name for f in dataclasses.fields(section)}
