"""The snapshot stream as a hostile or broken peer sends it, over a real local HTTP server:
a PAX header of hundreds of MiB (tarfile would read it whole: CVE-2024-6232), GNU long
names, links, endless padding, and a peer that trickles bytes. Each is cut off at its
header or at the fetch's one total deadline, and nothing lands in the snapshot directory."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from serve_process import serve_app

from preheat.engine.warm.snapshot_peer import NAME_HEADER, PATH, fetch_latest
from preheat.engine.warm.snapshot_transfer import BLOCK, BadTransfer, Extractor, member_header, parse_header

from .test_snapshot_peer import KEY, keys

NAME = "snap-00000000000000000001-peer-0123abcd"
MIB = 1 << 20


def typed_header(name: str, size: int, kind: bytes) -> bytes:
    """A valid ustar header of another entry type (x: PAX, L: GNU long name, 2: symlink)."""
    block = bytearray(member_header(name, size, 0))
    block[156:157] = kind
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}".encode() + b"\0 "
    return bytes(block)


class Peer:
    """What the hostile peer did: bytes it got out before the client hung up."""

    def __init__(self) -> None:
        self.sent = 0
        self.finished = threading.Event()


@pytest.fixture
def hostile():
    peers: dict[str, tuple[callable, Peer]] = {}
    app = FastAPI()

    @app.get(PATH)
    async def latest(kind: str = "pax"):
        body, seen = peers["current"]

        async def stream():
            try:
                async for chunk in body():
                    seen.sent += len(chunk)
                    yield chunk
            finally:
                seen.finished.set()

        return StreamingResponse(stream(), media_type="application/x-tar", headers={NAME_HEADER: NAME})

    with serve_app(app) as url:
        def run(body) -> Peer:
            seen = Peer()
            peers["current"] = (body, seen)
            return seen
        yield url, run


def test_a_300_mib_pax_header_is_refused_at_its_header(hostile, tmp_path):
    url, run = hostile

    async def pax_of_digits():
        yield typed_header("././@PaxHeader", 300 * MIB, b"x")
        for _ in range(300):
            await asyncio.sleep(0)  # let the server notice a hang-up, as a real one would
            yield b"9" * MIB

    seen = run(pax_of_digits)
    fetched = fetch_latest(url, tmp_path, keys=keys(KEY), timeout=60, max_bytes=MIB)
    assert fetched.result == "refused" and "not a regular file" in fetched.detail
    assert seen.finished.wait(30)
    # The client stopped reading at the header: the peer got out a small fraction (socket
    # buffers), never the 300 MiB tarfile would have buffered.
    assert seen.sent < 64 * MIB
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", [b"L", b"K", b"g", b"2", b"1", b"5", b"3"])
def test_every_non_regular_entry_type_is_refused_before_its_data(kind):
    header = typed_header("manifest.json", 10**9, kind)
    with pytest.raises(BadTransfer, match="not a regular file"):
        parse_header(header, lambda name: True)


def test_a_member_larger_than_the_cap_is_refused_before_its_data(tmp_path):
    ex = Extractor(tmp_path, lambda n: True, max_bytes=MIB)
    with pytest.raises(BadTransfer, match="more than"):
        ex.feed(member_header("kv-00000.safetensors", 2 * MIB, 0))
    assert ex.total == 2 * MIB and ex.received == BLOCK and list(tmp_path.iterdir()) == []


def test_endless_padding_after_the_end_is_cut_at_the_byte_cap(tmp_path):
    ex = Extractor(tmp_path, lambda n: True, max_bytes=1024)
    ex.feed(member_header("manifest.json", 2, 0) + b"{}" + b"\0" * (BLOCK - 2) + b"\0" * (2 * BLOCK))
    with pytest.raises(BadTransfer, match="more than"):
        for _ in range(64):
            ex.feed(b"\0" * MIB)
    assert ex.received <= 1024 + 17 * MIB


def test_a_corrupt_header_checksum_and_a_base256_size_are_refused():
    block = bytearray(member_header("manifest.json", 10, 0))
    block[0] = ord("M")
    with pytest.raises(BadTransfer, match="checksum"):
        parse_header(bytes(block), lambda n: True)
    block = bytearray(member_header("manifest.json", 10, 0))
    block[124:136] = b"\x80" + b"\0" * 10 + b"\x01"
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}".encode() + b"\0 "
    with pytest.raises(BadTransfer, match="not octal"):
        parse_header(bytes(block), lambda n: True)


def test_a_peer_that_trickles_is_cut_off_at_the_total_deadline(hostile, tmp_path):
    """One byte every 50 ms: every read succeeds well within any per-read timeout, so only
    a deadline over the whole transfer stops it."""
    url, run = hostile

    async def trickle():
        yield member_header("manifest.json", 10 * MIB, 0)
        while True:
            await asyncio.sleep(0.05)
            yield b"{"

    seen = run(trickle)
    fetched = fetch_latest(url, tmp_path, keys=keys(KEY), timeout=1.5, max_bytes=64 * MIB)
    assert fetched.result == "timeout", fetched
    assert seen.finished.wait(30)  # the connection was closed: the peer's stream ended
    assert seen.sent < BLOCK + 10 * MIB  # cut off long before the member was complete
    assert list(tmp_path.iterdir()) == []  # the partial temp dir is gone


def test_a_stream_cut_inside_a_member_is_refused(hostile, tmp_path):
    url, run = hostile

    async def cut():
        yield member_header("manifest.json", 4096, 0)
        yield b"{" * 100

    run(cut)
    fetched = fetch_latest(url, tmp_path, keys=keys(KEY), timeout=30)
    assert fetched.result == "refused" and "inside a member" in fetched.detail
    assert list(tmp_path.iterdir()) == []
