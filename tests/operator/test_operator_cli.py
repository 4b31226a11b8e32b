"""`preheat operator` flags become one OperatorConfig."""

from preheat.operator.config import parse_args, startup_priority


def test_defaults_to_one_namespace_standalone(monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    cfg = parse_args(["--namespace", "llm"])
    assert (cfg.namespaces, cfg.all_namespaces, cfg.standalone) == (("llm",), False, True)


def test_peering_turns_standalone_off_and_all_namespaces_drops_the_list():
    cfg = parse_args(["--all-namespaces", "--peering", "preheat"])
    assert cfg.all_namespaces and not cfg.standalone and cfg.peering == "preheat"


def test_the_pod_namespace_is_the_default_scope(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "preheat-system")
    assert parse_args([]).namespaces == ("preheat-system",)


def test_an_earlier_start_means_a_higher_peering_priority():
    # Replicas share flags; kopf freezes all operators whose priorities tie.
    assert startup_priority(1_000_000_000) > startup_priority(1_000_001_000)
    assert parse_args(["--peering", "p"]).priority is None  # main picks startup_priority()
    assert parse_args(["--peering", "p", "--priority", "100"]).priority == 100


def test_a_crashed_replica_blocks_the_others_for_the_peering_lifetime_20_s_by_default():
    assert parse_args(["--peering", "p"]).peering_lifetime == 20
    assert parse_args(["--peering", "p", "--peering-lifetime", "45"]).peering_lifetime == 45


def test_a_peering_lifetime_too_short_to_renew_in_time_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        parse_args(["--peering", "p", "--peering-lifetime", "8"])
    assert "at least 15 seconds" in capsys.readouterr().err


def test_the_built_in_autoscaler_decides_every_15_s_like_the_hpa_unless_told(monkeypatch):
    import pytest

    cfg = parse_args([])
    assert (cfg.autoscale_interval, cfg.metrics_timeout) == (15.0, 2.0)
    cfg = parse_args(["--autoscale-interval", "1", "--metrics-timeout", "0.5"])
    assert (cfg.autoscale_interval, cfg.metrics_timeout) == (1.0, 0.5)
    monkeypatch.setenv("PREHEAT_OPERATOR_AUTOSCALE_INTERVAL", "3")
    assert parse_args([]).autoscale_interval == 3.0
    with pytest.raises(SystemExit):
        parse_args(["--autoscale-interval", "0"])
