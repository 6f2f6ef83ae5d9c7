"""Fixtures shared by the integration tier's modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.openai_support import FakeEngine, ServerThread


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[FakeEngine, ServerThread]]:
    """An OpenAI-shaped :class:`FakeEngine` on a real uvicorn server, one per module."""
    fake = FakeEngine()
    server = ServerThread(fake.app())
    yield fake, server
    server.stop()
