"""Bad snapshots made from a good one, the way they happen in a cluster: a pod of another
model, dtype or page size sharing the volume; a write cut short; a flipped bit on disk; a
manifest that lies; a manifest that points outside its directory."""

from __future__ import annotations

import json
import secrets
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"


def copy_as(good: Path, root: Path, created_ns: int, writer: str) -> Path:
    """A copy of `good` under a fresh snapshot name, so its age decides the reading order."""
    dst = root / f"snap-{created_ns:020d}-{writer}-{secrets.token_hex(4)}"
    shutil.copytree(good, dst)
    return dst


def _edit(path: Path, change: Callable[[dict], None]) -> None:
    m = json.loads((path / MANIFEST).read_text())
    change(m)
    (path / MANIFEST).write_text(json.dumps(m))


def _first_file(path: Path) -> Path:
    return path / json.loads((path / MANIFEST).read_text())["prefixes"][0]["file"]


def _flip_bit_in_first_tensor(path: Path) -> None:
    """Flips one bit in the middle of the first prefix's data (always restored: pinned first)."""
    m = json.loads((path / MANIFEST).read_text())
    entry = m["prefixes"][0]
    file = path / entry["file"]
    raw = bytearray(file.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8 : 8 + header_len])[entry["tensor"]]["data_offsets"]
    raw[8 + header_len + (start + end) // 2] ^= 0x10
    file.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    file = _first_file(path)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _escape(path: Path) -> None:
    def change(m: dict) -> None:
        name = next(iter(m["files"]))
        m["files"] = {f"../{name}": m["files"][name]}
        for e in m["prefixes"]:
            e["file"] = f"../{e['file']}"

    _edit(path, change)


def _symlink_outside(path: Path) -> None:
    """The tensor file is a symlink to a file outside the snapshot (another pod's, /dev/...)."""
    file = _first_file(path)
    outside = path.parent.parent / f"outside-{path.name}.safetensors"
    file.rename(outside)
    file.symlink_to(outside)


def _lie_about_file_size(path: Path) -> None:
    def change(m: dict) -> None:
        for info in m["files"].values():
            info["size"] -= 128

    _edit(path, change)


def _lie_about_token_count(path: Path) -> None:
    def change(m: dict) -> None:
        m["prefixes"][0]["num_tokens"] += 16  # more than its token ids and its tensor hold

    _edit(path, change)


def _fingerprint(key: str, value: object) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        _edit(path, lambda m: m["fingerprint"].__setitem__(key, value))

    return damage


# name -> (how to damage a copy, the refusal reason the engine must report)
DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "other-model": (_fingerprint("model_id", "sha256:another-fine-tune"), "fingerprint_mismatch"),
    "other-dtype": (_fingerprint("dtype", "bfloat16"), "fingerprint_mismatch"),
    "other-page-size": (_fingerprint("page_size", 32), "fingerprint_mismatch"),
    "truncated": (_truncate, "truncated"),
    "bit-flipped": (_flip_bit_in_first_tensor, "checksum_mismatch"),
    "lying-size": (_lie_about_file_size, "size_mismatch"),
    "lying-tokens": (_lie_about_token_count, "manifest_invalid"),
    "escaping-path": (_escape, "unsafe_path"),
    "symlink-outside": (_symlink_outside, "unsafe_path"),
}


def make_bad_snapshots(good: Path, root: Path, start_ns: int) -> dict[str, Path]:
    """One damaged copy of `good` per DAMAGES entry, each newer than `start_ns`, so a reader
    tries (and must refuse) every one of them before reaching anything older."""
    made = {}
    for i, (name, (damage, _)) in enumerate(DAMAGES.items()):
        path = copy_as(good, root, start_ns + (i + 1) * 1000, name)
        damage(path)
        made[name] = path
    return made
