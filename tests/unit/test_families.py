"""The contract's label buckets and families (``exporters/instrumentation/buckets.py``,
``families.py``) beyond ``test_mrc_metrics.py``: what a bad edge or a bad size says (an
application that passes custom edges to ``MRCMetrics`` reads these messages at start-up), one
negative side alone is enough to refuse an image size, and every family is declared once with
the label names its buckets need.
"""

from __future__ import annotations

import re

import pytest
from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters.instrumentation import MRCMetrics, buckets, families


@pytest.mark.parametrize(("call", "message"), [
    (lambda: buckets.prompt_length_values(()), "prompt length edges must not be empty"),
    (lambda: buckets.prompt_length_values((0, 50)),
     "prompt length edges must be positive, got (0, 50)"),
    (lambda: buckets.prompt_length_values((100, 50)),
     "prompt length edges must be strictly increasing, got (100, 50)"),
    (lambda: buckets.prompt_length_values((50.5, 100)),  # type: ignore[arg-type]
     "prompt length edges must be whole characters, got (50.5, 100)"),
    (lambda: buckets.resolution_values(()), "resolution edges must not be empty"),
    (lambda: buckets.resolution_values((-1.0, 4.0)),
     "resolution edges must be positive, got (-1.0, 4.0)"),
    (lambda: buckets.resolution_values((4.0, 4.0)),
     "resolution edges must be strictly increasing, got (4.0, 4.0)"),
    (lambda: buckets.prompt_length_bucket(-1), "prompt length must be >= 0, got -1"),
    (lambda: buckets.resolution_bucket(-1, 10), "image size must be >= 0, got -1x10"),
    (lambda: buckets.resolution_bucket(10, -1), "image size must be >= 0, got 10x-1"),
])
def test_bad_edges_and_sizes_say_what_is_wrong(call, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call()


def test_custom_edges_given_to_the_metrics_are_checked_with_the_same_messages() -> None:
    with pytest.raises(ValueError, match=r"^resolution edges must be strictly increasing"):
        MRCMetrics(CollectorRegistry(), resolution_edges_mp=(4.0, 1.0))
    with pytest.raises(ValueError, match=r"^prompt length edges must not be empty$"):
        MRCMetrics(CollectorRegistry(), prompt_edges=())


def test_a_single_negative_side_is_refused_even_when_the_area_would_be_zero() -> None:
    with pytest.raises(ValueError):
        buckets.resolution_bucket(-5, 0)
    with pytest.raises(ValueError):
        buckets.resolution_bucket(0, -5)
    assert buckets.resolution_bucket(0, 5) == "<1MP"  # zero is a size, an empty image


def test_every_family_is_declared_once_with_what_its_kind_needs() -> None:
    names = [f.name for f in families.FAMILIES]
    assert len(names) == len(set(names)) == 18
    for f in families.FAMILIES:
        assert f.name.startswith("mrc_") and f.help and f.help.endswith(".")
        assert bool(f.buckets) == (f.kind == "histogram"), f.name
        assert f.name.endswith("_total") == (f.kind == "counter"), f.name
    by_name = {f.name: f for f in families.FAMILIES}
    for name in ("mrc_request_duration_seconds", "mrc_time_to_first_token_seconds",
                 "mrc_time_per_output_token_seconds"):
        assert by_name[name].labelnames == ("prompt_length", "resolution")
    assert by_name["mrc_model_info"].mp_mode == "livemax"
    assert by_name["mrc_requests_total"].labelnames == ("outcome",)
    assert by_name["mrc_preprocess_abandoned_threads"].labelnames == ("pool",)
