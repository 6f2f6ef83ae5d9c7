"""The chat API's request rules (``reference_service/chat.py``) that depend on how two fields
relate, read without a server: the token budget's two names."""

from __future__ import annotations

from typing import Any

import pytest

from mrc_agent.reference_service.chat import DEFAULT_MAX_TOKENS, parse_chat
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.settings import Settings
from tests.openai_support import data_url

_MESSAGES = [{"role": "user", "content": [
    {"type": "text", "text": "hi"},
    {"type": "image_url", "image_url": {"url": data_url(8, 8)}}]}]


def _budget(**fields: Any) -> int:
    return parse_chat({"messages": _MESSAGES, **fields}, Settings(), None).max_tokens


@pytest.mark.parametrize(("fields", "want"), [
    # The OpenAI API deprecates max_tokens for max_completion_tokens; vLLM reads
    # "max_completion_tokens or max_tokens": the newer name wins, whichever is larger.
    ({"max_completion_tokens": 12, "max_tokens": 40}, 12),
    ({"max_completion_tokens": 40, "max_tokens": 12}, 40),
    ({"max_tokens": 40}, 40),
    ({"max_completion_tokens": 12}, 12),
    ({"max_completion_tokens": None, "max_tokens": 40}, 40),
    ({}, DEFAULT_MAX_TOKENS),
])
def test_the_newer_name_of_the_token_budget_wins(fields: dict[str, Any], want: int) -> None:
    assert _budget(**fields) == want


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_completion_tokens": 12, "max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 12}, "max_completion_tokens"),
    ({"max_completion_tokens": "12", "max_tokens": 12}, "max_completion_tokens"),
])
def test_either_name_given_badly_is_refused_even_beside_a_good_one(
        fields: dict[str, Any], param: str) -> None:
    """Both are read and checked, as vLLM's request model types both: a client's mistake in
    the one that loses is still its mistake, named."""
    with pytest.raises(ServiceError) as e:
        _budget(**fields)
    assert e.value.status == 400 and e.value.param == param
