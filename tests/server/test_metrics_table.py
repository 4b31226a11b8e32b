"""The metric declaration table and the Metrics class's annotations agree: every declared
metric is a typed attribute of the kind it is made as, and no name is declared twice."""

from __future__ import annotations

import typing

from preheat.engine.metrics import METRICS, Metrics


def test_every_declared_metric_is_an_annotated_attribute_of_its_kind() -> None:
    hints = typing.get_type_hints(Metrics)
    assert {d.attr for d in METRICS} == set(hints)
    for d in METRICS:
        assert hints[d.attr] is d.kind, d.attr
        assert isinstance(getattr(Metrics(), d.attr), d.kind)


def test_names_and_attributes_are_unique() -> None:
    assert len({d.name for d in METRICS}) == len(METRICS)
    assert len({d.attr for d in METRICS}) == len(METRICS)
