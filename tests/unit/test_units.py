"""The one parser of durations and byte sizes (``agent/core/units.py``), value by value."""

from __future__ import annotations

import pytest

from mrc_agent.agent.core.units import (
    check_prometheus_duration,
    format_duration,
    parse_bytes,
    parse_duration,
)


@pytest.mark.parametrize(("text", "seconds"), [
    (3600, 3600.0), (0.5, 0.5), ("90", 90.0), (" 2.5 ", 2.5), ("0", 0.0),
    ("90s", 90.0), ("30m", 1800.0), ("1h30m", 5400.0), ("7d", 604800.0), ("2w", 1209600.0),
    ("1y", 31536000.0), ("500ms", 0.5), ("1m500ms", 60.5), ("1y1w1d1h1m1s1ms", 32230861.001),
])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, abs=1e-9)


@pytest.mark.parametrize("text", [
    "", "s", "1.5h", "30 m", "1m1h", "1h1h", "-1", "-5s", "inf", "nan", "1e400", "5M", "1sec",
    True,
])
def test_not_durations(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_a_bad_duration_says_what_would_do() -> None:
    with pytest.raises(ValueError, match=r"'1\.5h' is not a duration such as 3600, 90s, 30m"):
        parse_duration("1.5h")


def test_prometheus_durations_are_the_unit_forms_only() -> None:
    assert check_prometheus_duration("1h30m") == "1h30m"
    for bad in ("90", "", "1.5h", "1m1h"):
        with pytest.raises(ValueError, match="not a Prometheus duration"):
            check_prometheus_duration(bad)


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.25, "250ms"), (1, "1s"), (59, "59s"), (60, "1m"), (90, "1m30s"),
    (3600, "1h"), (5400, "1h30m"), (86400, "1d"), (90061, "1d1h1m1s"), (61.5, "1m1s500ms"),
    (59.999, "59s999ms"), (0.0004, "0s"), (0.001, "1ms"), (0.0016, "2ms"),
])
def test_format_duration_round_trips(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds, abs=1e-3)
    assert check_prometheus_duration(text) == text


@pytest.mark.parametrize(("text", "n"), [
    (104857600, 104857600), (1.9, 1), ("0", 0), ("500", 500), ("500k", 500_000),
    ("100Mi", 100 * 1024**2), ("100MiB", 100 * 1024**2), ("1G", 10**9), ("1Gi", 1024**3),
    ("1.5Ki", 1536), ("2m", 2_000_000), (" 3 GB ", 3 * 10**9), ("4kib", 4096),
])
def test_bytes(text: object, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "Mi", "-1", "1T", "1 0", "ten", -1, float("inf"),
                                  float("nan")])
def test_not_bytes(text: object) -> None:
    with pytest.raises(ValueError, match="bytes"):
        parse_bytes(text)


def test_a_bad_duration_names_every_accepted_form() -> None:
    """The whole message a setting or flag shows, down to its last example."""
    with pytest.raises(ValueError) as info:
        parse_duration("soon")
    assert str(info.value) == ("'soon' is not a duration such as 3600, 90s, 30m, 1h30m, 7d or "
                               "500ms")


@pytest.mark.parametrize(("number", "n"), [(0, 0), (0.0, 0), (0.5, 0), (1, 1), (1e20, 10**20)])
def test_numbers_of_bytes_down_to_zero_are_taken_as_they_are(number: float, n: int) -> None:
    """Zero is a size (a disabled limit), and a number is never read back as text."""
    assert parse_bytes(number) == n


def test_a_bool_is_not_a_number_of_bytes() -> None:
    with pytest.raises(ValueError, match="expected bytes"):
        parse_bytes(True)


def test_bad_bytes_say_what_would_do() -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes("lots")
    assert str(info.value) == "expected bytes such as 104857600, 100Mi or 1G"
    with pytest.raises(ValueError, match=r"^-1 is not a finite, non-negative number of bytes$"):
        parse_bytes(-1)


@pytest.mark.parametrize("value", ["9" * 5000, "9" * 5000 + "s", "1" + "0" * 19 + "ms",
                                   10**5000, "9" * 400],
                         ids=["5000-digits", "5000-digit-seconds", "20-digit-ms", "int-10e5000",
                              "400-digits"])
def test_huge_durations_are_one_short_value_error(value: object) -> None:
    """Thousands of digits (a config value, a flag, a Prometheus answer) are refused as a
    duration in a message of its own size, never an OverflowError or int()'s digit limit."""
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert len(str(info.value)) < 160
    assert "int_max_str_digits" not in str(info.value)


@pytest.mark.parametrize("value", ["9" * 5000, "9" * 5000 + "Mi", 10**5000],
                         ids=["5000-digits", "5000-digit-Mi", "int-10e5000"])
def test_huge_byte_counts_are_one_short_value_error(value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    assert len(str(info.value)) < 160
    assert "int_max_str_digits" not in str(info.value)
