"""The wire format of a snapshot sent to a peer: plain ustar (POSIX.1-1988 tar), written and
read here, without `tarfile`.

`tarfile` reads a PAX or GNU long-name header whole before any size check (a 300 MiB
header: 48 -> 903 MiB peak; a 160 KB header of digits: 16 s of CPU, CVE-2024-6232). This
reader looks at fixed 512-byte headers only, and refuses anything but a regular file with
a snapshot file's name *before* reading a byte of what follows: a PAX, GNU long-name,
link, device or directory entry ends the transfer at its header. Member sizes count
against a byte cap before their data is read. It is fed chunks (sans I/O), so the caller
owns the deadline. The stream stays a valid tar: `tar tf` lists it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

BLOCK = 512
_REGULAR = (b"0", b"\0")
# Headers and padding a stream may carry beyond its members' bytes.
STREAM_OVERHEAD_BYTES = 16 << 20


class BadTransfer(ValueError):
    """The peer sent something that is not a snapshot directory's files."""


def _octal(value: int, width: int) -> bytes:
    return f"{value:0{width - 1}o}".encode() + b"\0"


def member_header(name: str, size: int, mtime: int) -> bytes:
    """A ustar header for a regular file (mode 0644)."""
    raw = name.encode("ascii")
    if len(raw) > 100 or size >= 8**11:
        raise ValueError(f"{name!r} ({size} bytes) does not fit a ustar header")
    header = bytearray(BLOCK)
    header[0:len(raw)] = raw
    header[100:108] = _octal(0o644, 8)
    header[108:116] = _octal(0, 8)
    header[116:124] = _octal(0, 8)
    header[124:136] = _octal(size, 12)
    header[136:148] = _octal(mtime, 12)
    header[148:156] = b" " * 8
    header[156:157] = b"0"
    header[257:265] = b"ustar\x0000"
    header[148:156] = f"{sum(header):06o}".encode() + b"\0 "
    return bytes(header)


def padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


END = b"\0" * (2 * BLOCK)


def _parse_octal(field: bytes, what: str) -> int:
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text or any(c not in b"01234567" for c in text):  # base-256 sizes too: refused
        raise BadTransfer(f"header field {what} is not octal: {field!r}")
    return int(text, 8)


def parse_header(block: bytes, allowed: Callable[[str], bool]) -> tuple[str, int]:
    """(name, size) of a regular-file header, or BadTransfer — decided from these 512
    bytes alone."""
    if _parse_octal(block[148:156], "chksum") != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        raise BadTransfer("header checksum mismatch")
    if not block[257:262] == b"ustar":
        raise BadTransfer("not a ustar header")
    kind = block[156:157]
    if kind not in _REGULAR:
        raise BadTransfer(f"entry type {kind!r} is not a regular file (PAX, long names and "
                          "links are refused before their data is read)")
    if block[345:500].strip(b"\0"):
        raise BadTransfer("a ustar name prefix is not a snapshot file name")
    name = block[0:100].split(b"\0", 1)[0].decode("ascii", "replace")
    if not allowed(name):
        raise BadTransfer(f"unexpected member {name!r}")
    return name, _parse_octal(block[124:136], "size")


class Extractor:
    """Writes the members of a ustar stream into `into`, fed chunk by chunk: only names
    `allowed` accepts, each once, `max_bytes` of member data in all. `close()` checks that
    the stream ended with the end-of-archive blocks."""

    def __init__(self, into: Path, allowed: Callable[[str], bool], max_bytes: int) -> None:
        self.into = into
        self.allowed = allowed
        self.max_bytes = max_bytes
        self.total = 0  # member bytes written
        self.received = 0  # stream bytes fed
        self._buf = bytearray()
        self._file: int | None = None
        self._left = 0  # data bytes of the current member still to come
        self._pad = 0  # padding bytes after it
        self._ended = False

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.max_bytes + STREAM_OVERHEAD_BYTES:  # e.g. endless padding
            raise BadTransfer(f"more than {self.max_bytes} bytes")
        if self._ended:
            if chunk.strip(b"\0"):
                raise BadTransfer("data after the end of the archive")
            return
        self._buf += chunk
        while self._step():
            pass

    def _step(self) -> bool:
        if self._left:
            n = min(self._left, len(self._buf))
            if not n:
                return False
            os.write(self._file, self._buf[:n])  # type: ignore[arg-type]
            del self._buf[:n]
            self._left -= n
            if not self._left:
                self._finish_member()
            return True
        if self._pad:
            n = min(self._pad, len(self._buf))
            del self._buf[:n]
            self._pad -= n
            return bool(n)
        if len(self._buf) < BLOCK:
            return False
        block = bytes(self._buf[:BLOCK])
        del self._buf[:BLOCK]
        if not block.strip(b"\0"):
            self._ended = True  # the first end block; the rest may be anything but data
            if self._buf.strip(b"\0"):
                raise BadTransfer("data after the end of the archive")
            self._buf.clear()
            return False
        name, size = parse_header(block, self.allowed)
        self.total += size
        if self.total > self.max_bytes:
            raise BadTransfer(f"more than {self.max_bytes} bytes")
        try:
            self._file = os.open(self.into / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise BadTransfer(f"member {name!r} sent twice") from None
        self._left, self._pad = size, -size % BLOCK
        if not size:
            self._finish_member()
        return True

    def _finish_member(self) -> None:
        assert self._file is not None
        try:
            os.fsync(self._file)
        finally:
            os.close(self._file)
            self._file = None

    def close(self) -> int:
        """Member bytes written; BadTransfer when the stream was cut short."""
        if self._file is not None:
            os.close(self._file)
            self._file = None
            raise BadTransfer("the stream ended inside a member")
        if not self._ended:
            raise BadTransfer("the stream ended without the end-of-archive blocks")
        return self.total
