"""The control messages rank 0 broadcasts to the tensor-parallel workers: one fixed layout of
int64s, never pickle.

Every message is one int64 tensor of the agreed capacity:

    [MAGIC, op, payload_length, next_capacity, payload..., zero padding]

so a worker always knows how much to receive (a broadcast needs the size up front) and a
step costs exactly ONE broadcast. The capacity only grows (powers of two, from
MIN_CAPACITY): when a payload does not fit, rank 0 first sends a RESIZE message in the old
capacity naming the new one. Over a process's life that happens a handful of times (during
warmup, usually), so steady serving is one broadcast per step.

A STEP payload carries the forward pass's inputs — the token ids and every field of
`AttentionMetadata` (positions, slots, page tables, sequence lengths, extend lengths) —
encoded field by field in the dataclass's order, each value tagged with its kind (None, int,
float, bool, list of ints, tensor with dtype and shape). Encoding the dataclass generically
means a field added to AttentionMetadata travels without a change here, as long as it is
one of those kinds (anything else is refused with a TypeError, never pickled).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Sequence
from typing import Any

import torch

from preheat.engine.model.layers import AttentionMetadata

MAGIC = 0x50485450  # "PHTP"
HEADER = 4  # magic, op, payload length, next capacity
MIN_CAPACITY = 1024


class Op(enum.IntEnum):
    STEP = 1  # run the forward pass on the payload's inputs
    READ_PAGES = 2  # send the KV of these pages to rank 0 (a gather)
    WRITE_PAGES = 3  # receive the KV of these pages from rank 0 (a scatter)
    RESIZE = 4  # messages from now on have `next_capacity` int64s
    SHUTDOWN = 5  # exit the worker loop


class ProtocolError(RuntimeError):
    """A message that is not ours (bad magic, op or length): ranks are out of step."""


def grown_capacity(current: int, needed: int) -> int | None:
    """The capacity to grow to so a message of `needed` int64s (header included) fits, or
    None when it fits the current one."""
    if needed <= current:
        return None
    cap = max(MIN_CAPACITY, current)
    while cap < needed:
        cap *= 2
    return cap


def frame(op: Op, payload: torch.Tensor, capacity: int, next_capacity: int) -> torch.Tensor:
    """The message buffer: header, payload, zeros up to `capacity`."""
    n = payload.numel()
    if HEADER + n > capacity:
        raise ValueError(f"payload of {n} does not fit capacity {capacity}")
    buf = torch.zeros(capacity, dtype=torch.int64)
    buf[:HEADER] = torch.tensor([MAGIC, int(op), n, next_capacity], dtype=torch.int64)
    buf[HEADER : HEADER + n] = payload
    return buf


def unframe(buf: torch.Tensor) -> tuple[Op, torch.Tensor, int]:
    """(op, payload view, next capacity) of a received buffer; ProtocolError when it is not
    a message of ours."""
    magic, op, n, next_capacity = (int(x) for x in buf[:HEADER].tolist())
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic:#x}: the ranks are out of step")
    try:
        kind = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if not 0 <= n <= buf.numel() - HEADER or next_capacity < buf.numel():
        raise ProtocolError(f"payload length {n} / next capacity {next_capacity} do not fit {buf.numel()}")
    return kind, buf[HEADER : HEADER + n], next_capacity


# --------------------------------------------------------------------------- values

_NONE, _INT, _FLOAT, _BOOL, _INTS, _TENSOR = range(6)
# dtype code -> (dtype, integer dtype of the same width its bits travel as)
_DTYPES: dict[int, tuple[torch.dtype, torch.dtype]] = {
    0: (torch.int64, torch.int64),
    1: (torch.int32, torch.int32),
    2: (torch.int16, torch.int16),
    3: (torch.int8, torch.int8),
    4: (torch.uint8, torch.uint8),
    5: (torch.bool, torch.bool),
    6: (torch.float32, torch.int32),
    7: (torch.float16, torch.int16),
    8: (torch.bfloat16, torch.int16),
    9: (torch.float64, torch.int64),
}
_CODES = {dtype: code for code, (dtype, _) in _DTYPES.items()}


def encode_values(values: Sequence[Any]) -> torch.Tensor:
    """Values as one flat int64 CPU tensor (see the module docstring for the kinds)."""
    parts: list[torch.Tensor] = []
    for i, v in enumerate(values):
        if v is None:
            parts.append(torch.tensor([_NONE]))
        elif isinstance(v, bool):
            parts.append(torch.tensor([_BOOL, int(v)]))
        elif isinstance(v, int):
            parts.append(torch.tensor([_INT, v]))
        elif isinstance(v, float):
            parts.append(torch.tensor([_FLOAT, struct.unpack("<q", struct.pack("<d", v))[0]]))
        elif isinstance(v, (list, tuple)):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise TypeError(f"value {i}: only lists of ints travel to the workers")
            parts.append(torch.tensor([_INTS, len(v), *v], dtype=torch.int64))
        elif isinstance(v, torch.Tensor):
            code = _CODES.get(v.dtype)
            if code is None:
                raise TypeError(f"value {i}: tensors of {v.dtype} do not travel to the workers")
            bits = v.detach().to("cpu").contiguous().view(_DTYPES[code][1]).reshape(-1).to(torch.int64)
            parts.append(torch.tensor([_TENSOR, code, v.dim(), *v.shape], dtype=torch.int64))
            parts.append(bits)
        else:
            raise TypeError(f"value {i}: {type(v).__name__} does not travel to the workers")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def decode_values(flat: torch.Tensor, device: torch.device | str = "cpu") -> list[Any]:
    """Inverse of encode_values; tensors are created on `device`."""
    out: list[Any] = []
    i, n = 0, flat.numel()

    def take(k: int) -> list[int]:
        nonlocal i
        if i + k > n:
            raise ProtocolError("a value runs past the end of the payload")
        got = flat[i : i + k].tolist()
        i += k
        return got

    while i < n:
        (kind,) = take(1)
        if kind == _NONE:
            out.append(None)
        elif kind == _INT:
            out.append(take(1)[0])
        elif kind == _BOOL:
            out.append(bool(take(1)[0]))
        elif kind == _FLOAT:
            out.append(struct.unpack("<d", struct.pack("<q", take(1)[0]))[0])
        elif kind == _INTS:
            (length,) = take(1)
            out.append(take(length))
        elif kind == _TENSOR:
            code, ndim = take(2)
            if code not in _DTYPES:
                raise ProtocolError(f"unknown dtype code {code}")
            shape = take(ndim)
            count = 1
            for s in shape:
                count *= s
            if i + count > n:
                raise ProtocolError("a tensor runs past the end of the payload")
            dtype, bits = _DTYPES[code]
            t = flat[i : i + count].to(bits).view(dtype).reshape(shape)
            i += count
            out.append(t.to(device))
        else:
            raise ProtocolError(f"unknown value kind {kind}")
    return out


# --------------------------------------------------------------------------- steps

_META_FIELDS = [f.name for f in dataclasses.fields(AttentionMetadata)]


def pack_step(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """A forward pass's inputs as a STEP payload."""
    return encode_values([input_ids, *(getattr(meta, name) for name in _META_FIELDS)])


def unpack_step(payload: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, AttentionMetadata]:
    values = decode_values(payload, device)
    if len(values) != 1 + len(_META_FIELDS):
        raise ProtocolError(f"a step carries {len(values)} values, expected {1 + len(_META_FIELDS)}")
    return values[0], AttentionMetadata(**dict(zip(_META_FIELDS, values[1:])))
