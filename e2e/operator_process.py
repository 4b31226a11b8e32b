"""The real operator, `preheat operator`, as a subprocess that a scenario can kill and
start again (a crash and a restart, with no state carried over in memory)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any


class OperatorProcess:
    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path,
                 resync_seconds: float = 5.0, extra_args: tuple[str, ...] = ()) -> None:
        self.kubeconfig = kubeconfig
        self.extra_args = tuple(extra_args)
        self.namespace = namespace
        self.log_dir = log_dir
        self.resync_seconds = resync_seconds
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    async def start(self) -> None:
        assert self.proc is None or self.proc.returncode is not None, "already running"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PREHEAT_", "KUBERNETES_"))}
        env["KUBECONFIG"] = str(self.kubeconfig)
        self.starts += 1
        log = (self.log_dir / f"operator-{self.starts}.log").open("wb")
        with log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "preheat", "operator", "--namespace", self.namespace,
                "--standalone", "--resync-seconds", str(self.resync_seconds), *self.extra_args,
                env=env, stdout=log, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signals the operator's process group; SIGKILL if it has not exited in time."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return None if proc is None else proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return await proc.wait()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:]
                         for p in sorted(self.log_dir.glob("operator-*.log")))

    async def __aenter__(self) -> OperatorProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
