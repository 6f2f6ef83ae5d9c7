"""Format negotiation (:func:`mrc_agent.exporters.render.negotiate`) as a table: what each
``Accept`` header is answered with, by the rules the module's docstring states."""

from __future__ import annotations

import pytest

from mrc_agent.exporters.render import ESCAPINGS, negotiate

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OM1 = "application/openmetrics-text; version=1.0.0; charset=utf-8"
PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def om(major: int, escaping: str = "underscores") -> str:
    return (f"application/openmetrics-text; version={major}.0.0; charset=utf-8; "
            f"escaping={escaping}")


def text1(escaping: str = "underscores") -> str:
    return f"text/plain; version=1.0.0; charset=utf-8; escaping={escaping}"


CASES = [
    ("", TEXT),
    ("*/*", TEXT),
    ("text/plain", TEXT),
    ("text/plain;version=0.0.4", TEXT),
    ("application/openmetrics-text", OM1),
    ("APPLICATION/OpenMetrics-Text", OM1),
    ("application/openmetrics-text;version=0.0.1", TEXT),  # before 1.0.0: not usable
    ("application/openmetrics-text;version=1.a", TEXT),  # not dotted digits
    ("application/openmetrics-text;q=0", TEXT),  # not acceptable
    ("application/openmetrics-text;q=0.000", TEXT),
    ("application/openmetrics-text;q=1.5", TEXT),  # not a qvalue
    ("application/openmetrics-text;bogus", TEXT),  # a parameter without a value
    ("application/openmetrics-text;q=0, text/plain;version=1.0.0",
     text1() if ESCAPINGS else TEXT),
    ("application/json, application/openmetrics-text", OM1),  # the first usable range
]
if ESCAPINGS:
    CASES += [
        (PROMETHEUS_2, om(1)),
        ("application/openmetrics-text;version=1.0.0", om(1)),
        ('application/openmetrics-text;version="1.0.0"', om(1)),
        ("application/openmetrics-text;version=1.9", om(1)),
        ("application/openmetrics-text;version=2.0.0", om(2)),
        ("application/openmetrics-text;version=3.1", om(2)),
        ("application/openmetrics-text;version=1.0.0;escaping=dots", om(1, "dots")),
        ("application/openmetrics-text;version=2.0.0;escaping=allow-utf-8",
         om(2, "allow-utf-8")),
        ("application/openmetrics-text;version=1.0.0;escaping=bogus", om(1)),
        ("application/openmetrics-text;version=1.0.0;version=2.0.0", om(1)),  # first kept
        ("application/openmetrics-text;VERSION=2.0.0;q=0.5", om(2)),
        ("application/openmetrics-text;version=1.0.0;q=1", om(1)),
        ("application/openmetrics-text;version=1.0.0;q=0.001", om(1)),
        ("application/openmetrics-text;version=1.0.0;;", om(1)),
        ("text/plain;version=1.0.0", text1()),
        ("text/plain;version=2.0.0;escaping=values", text1("values")),
        ("text/plain;version=1.0.0;escaping=dots, application/openmetrics-text", text1("dots")),
        ("application/openmetrics-text;version=0.0.1, text/plain;version=1.0.0", text1()),
    ]


@pytest.mark.parametrize(("accept", "content_type"), CASES)
def test_each_accept_header_gets_its_format(accept: str, content_type: str) -> None:
    assert negotiate(accept).content_type == content_type
