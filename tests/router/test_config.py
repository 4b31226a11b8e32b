"""`preheat router` flags: the measured defaults, env fallbacks, refused values."""

from __future__ import annotations

import pytest

from preheat.router.config import parse_args
from preheat.router.policy import Balance


def test_the_balance_defaults_are_the_policys_and_env_and_flags_override(monkeypatch):
    for name in ("POD_NAME", "POD_IP", "PREHEAT_ROUTER_BALANCE_FACTOR", "PREHEAT_ROUTER_SHARE_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    cfg = parse_args(["--service", "chat", "-n", "ml"])
    assert (cfg.balance_factor, cfg.balance_slack) == (Balance().factor, Balance().slack)
    assert (cfg.affinity_window, cfg.share_interval, cfg.pod_name, cfg.pod_ip) == (300.0, 0.5, None, None)
    monkeypatch.setenv("POD_NAME", "chat-router-abc123")  # what the operator sets
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    monkeypatch.setenv("PREHEAT_ROUTER_BALANCE_FACTOR", "2")
    cfg = parse_args(["--service", "chat", "-n", "ml", "--share-interval", "0"])
    assert (cfg.pod_name, cfg.pod_ip, cfg.balance_factor, cfg.share_interval) == (
        "chat-router-abc123", "10.1.2.3", 2.0, 0.0)


@pytest.mark.parametrize("flags", [["--balance-factor", "0.9"], ["--balance-slack", "-1"],
                                   ["--affinity-window", "-1"], ["--share-interval", "-0.5"]])
def test_values_that_cannot_work_are_refused(flags):
    with pytest.raises(SystemExit):
        parse_args(["--service", "chat", "-n", "ml", *flags])
