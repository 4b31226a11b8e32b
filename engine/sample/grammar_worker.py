"""Compiles grammars in a child process that can be killed at a deadline.

xgrammar compiles in C++ and cannot be interrupted: a short regex such as `.{0,1000}x` takes
seconds, and a thread running it would keep a core busy long after its request got its 400
(a second such request, another core). So compiles run in one child process: one past its
deadline is ended with SIGKILL and the next compile gets a fresh child. Children are forked
from a forkserver that has imported xgrammar already, so a new one is ready in a fraction
of a second; only the first start pays the import. (pebble's ProcessPool was tried: it
stops a timed-out worker with SIGTERM and a 3 s grace, and a worker inside C++ ignores
SIGTERM until the compile returns, so its timeout did not end anything sooner.)

The compiled grammar comes back in xgrammar's JSON serialization and is deserialized in
the engine process, where the matchers run.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # the first start imports xgrammar (and torch) in the forkserver
COMPILER_NICENESS = 10  # added to the server's niceness in the compiler process (see _serve)

# Set by `prestart()`: workers made afterwards start their child at once, in a thread.
_prestarted = False


class CompileTimeout(Exception):
    """The compile ran past its deadline; the child that ran it was killed."""


class CompileError(Exception):
    """xgrammar refused the grammar; the message is its reason."""


class WorkerBusy(Exception):
    """Another compile held the worker for longer than this one may wait."""


class WorkerUnavailable(Exception):
    """The child process could not be started or died for another reason than a deadline."""


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["xgrammar"])
        return ctx
    return multiprocessing.get_context("spawn")


def prestart() -> None:
    """Starts the forkserver now, and makes every GrammarWorker created from now on start
    its compiler child at once in a thread. `preheat serve` calls it the moment its flags
    are valid: the forkserver's import of xgrammar (and torch with it: seconds on a small
    CPU) then runs in its own process beside the server's imports and model load, not
    inside the warmup's first compile, which waited for all of it."""
    global _prestarted
    _prestarted = True
    if _context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _serve(conn: Connection, tokenizer_info_json: str) -> None:
    """The child: build the compiler once, then compile what arrives until the pipe closes.

    It runs at a lower CPU priority: a compile can take a whole core for its full time limit,
    and on a small CPU that starved the server's event loop (probes) and the step loop."""
    import xgrammar as xgr

    try:
        os.nice(COMPILER_NICENESS)
    except OSError:  # not allowed here: compile at the server's priority
        pass

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    conn.send(("ready", None))
    while True:
        try:
            kind, key = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if kind == "regex":
                grammar = compiler.compile_regex(key)
            elif kind == "structural_tag":  # tool calls (engine/tools/calling.py)
                grammar = compiler.compile_structural_tag(key)
            else:
                # No free whitespace: a small model can otherwise pad with spaces until
                # max_tokens. Strict mode closes the objects a json_schema declares.
                grammar = compiler.compile_json_schema(key, any_whitespace=False, strict_mode=kind == "json_schema")
            conn.send(("ok", grammar.serialize_json()))
        except Exception as e:  # every refusal goes back as a message
            conn.send(("error", str(e)))


def _stop(proc: Any, conn: Connection | None) -> None:
    if conn is not None:
        conn.close()
    if proc is not None and proc.is_alive():
        proc.kill()
        proc.join(5)


class GrammarWorker:
    """One compile at a time in one child process; thread-safe."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._lock = threading.Lock()  # one compile at a time
        self._start_lock = threading.Lock()  # one start at a time (a prestart, or a compile)
        self._proc: Any = None
        self._conn: Connection | None = None
        self._finalizer: Any = None
        self.kills = 0  # children ended at a deadline (tests and logs read it)
        if _prestarted:
            threading.Thread(target=self._start_quietly, name="grammar-prestart", daemon=True).start()

    def _start_quietly(self) -> None:
        """The child's start ahead of the first compile; a failure is only logged (that
        compile tries again and reports it)."""
        try:
            self._ensure_started()
        except WorkerUnavailable as e:
            log.warning("grammar compiler: early start failed (%s); the first compile retries", e)

    def compile(self, kind: str, key: str, timeout: float, wait: float) -> str:
        """The serialized compiled grammar. Raises CompileError (a bad grammar),
        CompileTimeout, WorkerBusy (waited `wait` s for another compile) or
        WorkerUnavailable."""
        if not self._lock.acquire(timeout=wait):
            raise WorkerBusy(f"another grammar compile is still running after {wait:g}s")
        try:
            self._ensure_started()
            assert self._conn is not None
            try:
                self._conn.send((kind, key))
                if not self._conn.poll(timeout):
                    self.kills += 1
                    self._restart_later()
                    raise CompileTimeout(f"compiling took longer than {timeout:g}s")
                status, payload = self._conn.recv()
            except (EOFError, OSError) as e:  # the child died: OOM killer, a crash
                self._restart_later()
                raise WorkerUnavailable(f"the grammar compiler process died: {e or type(e).__name__}") from None
            if status != "ok":
                raise CompileError(payload)
            return payload
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock, self._start_lock:  # the order compile() takes them in
            self._restart_later()

    def _restart_later(self) -> None:
        """Ends the child now; the next compile starts a new one."""
        if self._finalizer is not None:
            self._finalizer()  # kills the child and closes the pipe, once
        self._proc, self._conn, self._finalizer = None, None, None

    def _ensure_started(self) -> None:
        # Not the compile lock: a compile waiting for a prestart in progress must not give
        # up after its `wait` (WorkerBusy); it waits for the start, as when it starts it.
        with self._start_lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        self._restart_later()
        ctx = _context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self._info), name="grammar-compiler", daemon=True)
        try:
            proc.start()
        except Exception as e:
            parent.close()
            raise WorkerUnavailable(f"cannot start the grammar compiler process: {e}") from None
        child.close()
        # A worker that is garbage-collected (an engine dropped in a test) ends its child.
        self._finalizer = weakref.finalize(self, _stop, proc, parent)
        self._proc, self._conn = proc, parent
        try:
            if not parent.poll(START_TIMEOUT_S) or parent.recv()[0] != "ready":
                raise EOFError("no ready message")
        except (EOFError, OSError) as e:
            self._restart_later()
            raise WorkerUnavailable(f"the grammar compiler process did not start: {e}") from None
        log.info("grammar compiler process started (pid %s)", proc.pid)
