"""The service's error type: the status comes from the code table, 4xx alone is the client's
fault, and the JSON body and the exception's text carry the code and the message unchanged."""

from __future__ import annotations

import pytest

from mrc_agent.reference_service.errors import STATUS_BY_CODE, ServiceError


def test_of_takes_the_status_from_the_table() -> None:
    for code, status in STATUS_BY_CODE.items():
        e = ServiceError.of(code, "why")
        assert (e.status, e.code, e.message) == (status, code, "why")
        assert isinstance(e, ServiceError)


def test_of_refuses_a_code_outside_the_table() -> None:
    with pytest.raises(KeyError):
        ServiceError.of("no_such_code", "why")


def test_the_three_fields_are_kept_as_given() -> None:
    e = ServiceError(418, "teapot", "short and stout")
    assert (e.status, e.code, e.message) == (418, "teapot", "short and stout")
    assert str(e) == "teapot: short and stout"
    assert e.args == ("teapot: short and stout",)


@pytest.mark.parametrize(("status", "client"), [
    (399, False), (400, True), (413, True), (499, True), (500, False), (502, False),
])
def test_only_4xx_is_a_client_error(status: int, client: bool) -> None:
    assert ServiceError(status, "x", "m").is_client_error is client


def test_every_table_code_is_a_client_error_exactly_when_it_is_4xx() -> None:
    for code, status in STATUS_BY_CODE.items():
        assert ServiceError.of(code, "m").is_client_error is (status < 500), code


def test_the_response_body_holds_code_and_message_only() -> None:
    e = ServiceError.of("fetch_timeout", "took longer than 5s")
    assert e.to_json() == {"error": {"code": "fetch_timeout", "message": "took longer than 5s"}}


def test_repr_names_code_status_and_message() -> None:
    e = ServiceError.of("image_empty", "zero bytes")
    assert repr(e) == "ServiceError(code='image_empty', status=400, message='zero bytes')"
