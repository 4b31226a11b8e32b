"""Reads a few scalar metadata fields from a GGUF file's header, fast.

`gguf.GGUFReader` (what transformers uses) decodes every field and tensor record into numpy
objects: ~5 s for the embedded 135M model, most of it the 49k-entry vocabulary. Deciding
whether we can run a file needs three scalars (`general.architecture`, `general.name`,
`<arch>.expert_count`), so this walks the key/value section and skips everything else by
its length: milliseconds, cheap enough to check a --model before the server starts.
(Recent transformers has a similar reader, but internal and absent from the 4.x releases
pyproject.toml still accepts; this needs only the `gguf` package's constants.)
Layout (GGUF v2/v3, little-endian): magic, u32 version, u64 tensor count, u64 kv count,
then per kv: string key, u32 value type, value; a string is u64 length + bytes, an array
u32 element type + u64 count + elements. Then per tensor: string name, u32 n_dims, u64 dims
(innermost first), u32 type, u64 offset from the data section, which starts at the next
multiple of `general.alignment` (32 when absent). `read_gguf_tensors` reads that table the
same way: the int8 path reads a block-quantized file's matrices at every start, and
GGUFReader spent ~2.5 s of a 3 s load decoding the vocabulary it does not need.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUF_MAGIC, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")  # read first: it moves pos
        self.pos += n

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype == GGUFValueType.STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[GGUFValueType(etype)])
            elif etype == GGUFValueType.STRING:  # a vocabulary: ~100k strings, one tight loop
                buf, pos, length = self.buf, self.pos, _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.value(etype, keep=False)
            return None  # arrays are never asked for
        return self.unpack(_SCALARS[GGUFValueType(vtype)])


@contextlib.contextmanager
def _header(path: str | Path) -> Iterator[tuple[_Cursor, int, int]]:
    """(cursor at the first key/value, tensor count, key/value count) of a GGUF v2/v3 file,
    memory-mapped while the block runs; a truncated or garbled header is a ValueError."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        try:
            if cur.unpack("<I") != GGUF_MAGIC:
                raise ValueError(f"{path}: not a GGUF file")
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            n_tensors = cur.unpack("<Q")
            yield cur, n_tensors, cur.unpack("<Q")
        except (struct.error, KeyError) as exc:
            raise ValueError(f"{path}: damaged GGUF header ({exc})") from None


def read_gguf_metadata(path: str | Path, keys: set[str]) -> dict[str, Any]:
    """The asked-for scalar/string fields that the file has (absent keys are left out).
    Raises ValueError for a file that is not GGUF v2/v3."""
    with _header(path) as (cur, _n_tensors, n_kv):
        found: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.unpack("<I"), keep=key in keys)
            if key in keys:
                found[key] = value
                if len(found) == len(keys):
                    break
        return found


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]  # outermost first (numpy order): [rows, columns] of a matrix
    tensor_type: int  # gguf.GGMLQuantizationType value
    start: int  # byte offset in the file
    nbytes: int


def read_gguf_tensors(path: str | Path) -> list[TensorRecord]:
    """The file's tensor table, each record with its absolute byte range. Raises ValueError
    for a file that is not GGUF v2/v3 or whose table does not fit the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with _header(path) as (cur, n_tensors, n_kv):
        alignment = 32
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.unpack("<I"), keep=key == "general.alignment")
            if key == "general.alignment":
                alignment = int(value)
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            kind, offset = cur.unpack("<I"), cur.unpack("<Q")
            table.append((name, tuple(reversed(dims)), kind, offset))
        data = -(-cur.pos // alignment) * alignment
        out = []
        for name, shape, kind, offset in table:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            count = 1
            for d in shape:
                count *= d
            record = TensorRecord(name, shape, kind, data + offset, count // block * block_bytes)
            if record.start + record.nbytes > len(cur.buf):
                raise ValueError(f"{path}: tensor {name} runs past the end of the file")
            out.append(record)
        return out


def gguf_identity(path: str | Path) -> tuple[str, str, int]:
    """(general.architecture, general.name, <arch>.expert_count or 0)."""
    head = read_gguf_metadata(path, {"general.architecture"})
    arch = str(head.get("general.architecture", ""))
    rest = read_gguf_metadata(path, {"general.name", f"{arch}.expert_count"})
    return arch, str(rest.get("general.name", "")), int(rest.get(f"{arch}.expert_count", 0) or 0)
