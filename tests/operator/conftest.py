"""Fixtures of the operator tests that run the real kopf operator against the API emulator
(test_operator_kmock.py, test_operator_failover_kmock.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import kmock
import kopf
import pytest
from kmock_apiserver import KubeAPIServer, write_kubeconfig

from preheat.operator.config import OperatorConfig
from preheat.operator.kube import Kube

NS = "default"


@pytest.fixture
def resync_seconds() -> float:
    return 1.0


@pytest.fixture
async def cluster(tmp_path, monkeypatch, resync_seconds) -> AsyncIterator[Kube]:
    """An emulated API server with the operator running against it; yields a user client."""
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, server.url)))
        from preheat.operator import handlers

        stop = asyncio.Event()
        memo = handlers.OperatorState(config=OperatorConfig(namespaces=(NS,), standalone=True,
                                                            resync_seconds=resync_seconds))
        operator = asyncio.create_task(kopf.operator(
            standalone=True, namespaces=[NS], memo=memo, stop_flag=stop))
        user = Kube(kopf.ConnectionInfo(server=str(server.url).rstrip("/")))
        try:
            yield user
        finally:
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(operator, timeout=10)
            await user.close()
        # kopf ends its root task by cancellation when stopped; anything else is a crash.
        assert operator.cancelled() or operator.exception() is None


