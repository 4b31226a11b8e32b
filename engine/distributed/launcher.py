"""Rank 0's side of tensor parallelism: start the worker processes, drive them, watch them,
stop them.

The workers are `python -m preheat.engine.distributed.worker` processes (one per rank
1..N-1), started before rank 0 loads the checkpoint so their start-up overlaps it; they read
a Hugging Face directory themselves and, for a GGUF, wait until rank 0 has converted it once
into the weight cache, then read that. They meet rank 0 through a FileStore in a private
temp directory (mode 0700): a TCPStore listens on every interface whatever host it is
given, with no authentication, so anyone who reaches the pod could join or poison the
rendezvous. The collectives' own sockets (gloo, NCCL's bootstrap) are held to the loopback
interface (comm.py). Settings travel as JSON through the store and the command line,
never pickled.

Lifetimes are tied to rank 0 three ways: each worker holds the read end of a pipe whose
write end only rank 0 holds, and exits when it reads EOF (rank 0 gone, however it died);
rank 0 tells the workers to stop when it closes (and kills what does not); and a monitor
thread here notices a worker that exits on its own, which makes rank 0 fail loudly: the
failure is raised from the next step (and from the idle loop's `has_unfinished`), the step
loop declares the engine dead, /health answers 503.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from preheat.engine.distributed.comm import Comm, TensorParallelFailure, backend_for, device_for_rank
from preheat.engine.distributed.kv import ShardedKVPool
from preheat.engine.distributed.messages import Op, pack_step
from preheat.engine.distributed.sharding import Sharder, TensorParallelError, check_tp_size, local_kv_heads
from preheat.engine.dtypes import dtype_name

log = logging.getLogger(__name__)

STORE_PREFIX = "preheat/tp/"
STARTUP_TIMEOUT_S = 1800.0  # a large model on a cold node loads for many minutes
COLLECTIVE_TIMEOUT_S = 600.0  # a collective nobody answers (NCCL hang) ends in an error
MONITOR_PERIOD_S = 0.2
STOP_WAIT_S = 10.0


class TensorParallel:
    """Rank 0's handle on the group. Everything that issues collectives runs under
    `exclusive()`, so a snapshot export never interleaves with a forward pass."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.rank = 0
        self.quantization: str | None = None  # --quantization (int8 shards cut at whole blocks)
        self.comm: Comm | None = None
        self.procs: list[subprocess.Popen] = []
        self.failure: TensorParallelFailure | None = None
        self._lifeline: int | None = None  # write end of the workers' pipe; closing it stops them
        self._store: Any = None
        self._lock = threading.RLock()
        self._closing = False
        self._monitor: threading.Thread | None = None

    # ------------------------------------------------------------ start

    @classmethod
    def launch(cls, config: Any, device: torch.device, dtype: torch.dtype) -> TensorParallel:
        """Starts the workers, before rank 0 loads the checkpoint, so their start-up (Python,
        torch) overlaps rank 0's load. A worker of a Hugging Face directory loads its shard at
        once; for a GGUF it waits for the directory rank 0 converts it into (`join`)."""
        size = config.tensor_parallel_size
        if dist.is_initialized():  # the group is the process's default one
            raise TensorParallelError("one tensor-parallel engine per process: close the other one first")
        if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
            raise TensorParallelError(f"--tensor-parallel-size {size} needs {size} GPUs from {device}, "
                                      f"{torch.cuda.device_count()} visible")  # fmt: skip
        weights_dir = config.model if config.model and os.path.isdir(config.model) else None
        if weights_dir is not None:  # refuse a size that does not divide before starting anyone
            from transformers import AutoConfig

            from preheat.engine.model.spec import ModelSpec

            check_tp_size(ModelSpec.from_hf_config(AutoConfig.from_pretrained(weights_dir)), size,
                          config.quantization)  # fmt: skip
        tp = cls(size, device)
        tp.quantization = config.quantization
        atexit.register(tp.close)
        try:
            tp._spawn(config, dtype, weights_dir)
        except BaseException:
            tp.close()
            raise
        return tp

    def _spawn(self, config: Any, dtype: torch.dtype, weights_dir: str | None) -> None:
        self._store_dir = tempfile.mkdtemp(prefix="preheat-tp-")  # 0700: this user only
        store_path = os.path.join(self._store_dir, "store")
        self._store = dist.FileStore(store_path, self.size)
        self._store.set_timeout(timedelta(seconds=STARTUP_TIMEOUT_S))
        read_end, self._lifeline = os.pipe()
        model = {
            "weights_dir": weights_dir,  # None: ask the store once rank 0 has loaded
            "source": config.model,
            "weight_cache_dir": config.weight_cache_dir,
            "dtype": dtype_name(dtype),
            "quantization": config.quantization,  # each rank quantizes whole matrices, then cuts
            "int8_activation_bits": config.int8_activation_bits,
        }
        try:
            for rank in range(1, self.size):
                args = {
                    "rank": rank, "size": self.size, "store_path": store_path, "lifeline_fd": read_end,
                    "device": str(device_for_rank(self.device, rank)), "model": model,
                    "log_level": config.log_level, "timeout_s": COLLECTIVE_TIMEOUT_S,
                }  # fmt: skip
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "preheat.engine.distributed.worker", json.dumps(args)],
                    pass_fds=(read_end,),
                ))  # fmt: skip
        finally:
            os.close(read_end)  # only the workers hold it now
        log.info("tensor parallel: started %d worker(s) (pids %s), %s backend", self.size - 1,
                 ", ".join(str(p.pid) for p in self.procs), backend_for(self.device))  # fmt: skip

    def join(self, loaded: Any) -> None:
        """After rank 0 loaded the checkpoint: tells the workers where it is (the weight-cache
        directory of a converted GGUF), waits until each has built its shard, and joins the
        process group with them."""
        check_tp_size(loaded.spec, self.size, self.quantization)
        self._store.set(STORE_PREFIX + "weights", json.dumps({"weights_dir": loaded.hf_dir}))
        self._wait_for("loaded", "to load their shards")
        self.comm = Comm.init(self._store, 0, self.size, self.device, COLLECTIVE_TIMEOUT_S)
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    def _wait_for(self, what: str, doing: str) -> None:
        """Waits until every worker set STORE_PREFIX + what/<rank>, or fails when one exits."""
        keys = [f"{STORE_PREFIX}{what}/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise TensorParallelFailure(
                        f"tensor-parallel worker rank {rank} exited with code {proc.returncode} while waiting "
                        f"for the workers {doing} (its log is above)"
                    )
            if time.monotonic() > deadline:
                raise TensorParallelFailure(f"the tensor-parallel workers did not manage {doing} in time")
            time.sleep(0.05)

    def sharder(self, spec: Any) -> Sharder:
        return Sharder(spec, self.size, 0)

    def local_kv_heads(self, num_kv_heads: int) -> int:
        return local_kv_heads(num_kv_heads, self.size)

    def make_pool(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                  dtype: torch.dtype) -> ShardedKVPool:  # fmt: skip
        """Rank 0's pool; the workers allocate the same pages for their heads."""
        heads = self.local_kv_heads(num_kv_heads)
        pool = ShardedKVPool(self, num_kv_heads, num_layers, heads, head_dim, num_pages, page_size, dtype,
                             self.device)  # fmt: skip
        self._store.set(STORE_PREFIX + "pool", json.dumps({
            "num_pages": num_pages, "page_size": page_size, "dtype": dtype_name(dtype),
        }))  # fmt: skip
        self._wait_for("ready", "to allocate their KV pools")
        return pool

    # ------------------------------------------------------------ driving

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Holds the group for one operation (a message and the collectives that follow it).
        Anything raised in between leaves the ranks out of step — the workers wait for a
        collective rank 0 will not issue — so it fails the group for good, as a
        TensorParallelFailure."""
        with self._lock:
            self.check()
            try:
                yield
            except TensorParallelFailure:
                raise
            except Exception as exc:
                self._fail(f"a tensor-parallel step failed, the ranks are out of step: {type(exc).__name__}: {exc}")
                raise self.failure from exc  # type: ignore[misc]

    def send(self, op: Op, payload: torch.Tensor | None = None) -> None:
        assert self.comm is not None
        self.comm.send(op, payload)

    def gather_to_rank0(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        assert self.comm is not None
        return self.comm.gather_to_rank0(local)

    def scatter_from_rank0(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        assert self.comm is not None
        return self.comm.scatter_from_rank0(parts, like)

    def broadcast_step(self, input_ids: torch.Tensor, meta: Any) -> None:
        """The one broadcast of a step: the forward pass's inputs, to every worker."""
        self.send(Op.STEP, pack_step(input_ids, meta))

    # ------------------------------------------------------------ health

    def check(self) -> None:
        """Raises the group's failure, if any (a worker died, a collective failed)."""
        if self.failure is not None:
            raise self.failure

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = TensorParallelFailure(message)
            log.error("tensor parallel: %s; the engine cannot go on", message)

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing:
                    self._fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}")
                    self._abort_collectives()
                    return
            time.sleep(MONITOR_PERIOD_S)

    def _abort_collectives(self) -> None:
        """NCCL waits for a dead peer until its timeout; aborting the group makes a pending
        collective raise now. gloo notices the closed connection by itself."""
        if backend_for(self.device) != "nccl":
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            try:
                abort()
            except Exception as exc:
                log.warning("tensor parallel: could not abort the process group: %s", exc)

    # ------------------------------------------------------------ stop

    def close(self) -> None:
        """Stops the workers (asking first, when no collective is in flight) and leaves the
        group. Safe to call more than once and from atexit."""
        if self._closing:
            return
        self._closing = True
        if self.comm is not None and self.failure is None and self._lock.acquire(timeout=2.0):
            try:
                self.comm.send(Op.SHUTDOWN)
            except Exception as exc:
                log.debug("tensor parallel: shutdown message not delivered: %s", exc)
            finally:
                self._lock.release()
        if self._lifeline is not None:
            os.close(self._lifeline)  # EOF on every worker's lifeline
            self._lifeline = None
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor parallel: worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        if self.comm is not None:
            self.comm.close()
        self._store = None
        if getattr(self, "_store_dir", None):
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        log.info("tensor parallel: workers stopped")

