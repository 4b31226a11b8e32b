"""The one way anything in a snapshot directory is opened: a regular file, not followed
through a symlink, read at most up to a cap.

The snapshot volume is shared and untrusted. A `manifest.json` that is a FIFO blocks a
reader (and a pruner holding the save lock) forever; a symlink to /dev/zero makes a read
unbounded; a symlink to another file reads what the writer had no right to. So: open with
O_NOFOLLOW (a symlink fails with ELOOP) and O_NONBLOCK (opening a FIFO never waits for a
writer), relative to a directory opened the same way, then fstat the open descriptor — what
is read is what was checked, with no window for a swap — and read at most `cap` bytes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
    getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | \
    getattr(os, "O_CLOEXEC", 0)


class UnsafeEntry(OSError):
    """Not a regular file (or directory): a symlink, FIFO, device or socket."""


class TooLarge(OSError):
    """A file longer than the cap its reader allows."""


def open_dir(path: str | os.PathLike, dir_fd: int | None = None) -> int:
    """A directory's descriptor; a symlink or a non-directory raises UnsafeEntry."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntry(e.errno, f"{Path(path).name} is not a directory (a symlink?)") from None
        raise


def open_regular(name: str | os.PathLike, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """(descriptor, its fstat) of a regular file; anything else raises UnsafeEntry and a
    missing file FileNotFoundError. The caller closes the descriptor."""
    try:
        fd = os.open(name, _FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeEntry(e.errno, f"{Path(name).name} is a symlink") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeEntry(errno.EINVAL, f"{Path(name).name} is not a regular file")
    return fd, st


def read_fd(fd: int, cap: int, name: str = "file") -> bytes:
    """At most `cap` bytes from an open descriptor; one more raises TooLarge (the size fstat
    reported may be a lie on network filesystems, so the read itself is bounded)."""
    chunks, total = [], 0
    while True:
        chunk = os.read(fd, min(1 << 20, cap + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > cap:
            raise TooLarge(errno.EFBIG, f"{name} is larger than {cap} bytes")


def read_regular(name: str | os.PathLike, cap: int, dir_fd: int | None = None) -> bytes:
    """The whole of a regular file of at most `cap` bytes (UnsafeEntry, TooLarge,
    FileNotFoundError otherwise)."""
    fd, st = open_regular(name, dir_fd)
    try:
        if st.st_size > cap:
            raise TooLarge(errno.EFBIG, f"{Path(name).name} is {st.st_size} bytes, more than {cap}")
        return read_fd(fd, cap, Path(name).name)
    finally:
        os.close(fd)


def fd_path(fd: int, fallback: str | os.PathLike) -> str:
    """A path that opens exactly this descriptor's file (for libraries that take a path,
    such as safetensors): /proc/self/fd/N where /proc is mounted, else `fallback`."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(fallback)
