"""A streamed answer: the text of the tokens generated so far, handed on piece by piece, and a
stop the caller can pull between two tokens.

:class:`TextPieces` turns token ids into text as they come. Each piece is what the decoded text
gained since the last one, so the pieces joined are the answer a whole generation returns
(``decode(ids).strip()``): leading whitespace is never sent, trailing whitespace waits until
something follows it (and is dropped at the end), and a character whose bytes span several
tokens (byte-level BPE) waits for its last byte instead of going out as U+FFFD. Decoding the
whole answer again at each token costs O(n) per token, nothing next to a decoder step for the
few hundred tokens an answer has at most. A tokenizer whose decoding of a longer answer
rewrites text already sent (clean-up of spaces before punctuation) cannot take it back: what was
sent stands, new text follows once the decoded text agrees with it again, and the streamed
answer's text is what was sent (:attr:`TextPieces.sent`), so the client's text and the answer
the service keeps are one.

:func:`stop_criteria` is a ``generate`` stopping criterion that ends the generation at the next
token once an event is set: the service sets it when the client of a stream has left.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

#: Decoded text ending in this is a character still missing bytes.
_INCOMPLETE = "\ufffd"


class TextPieces:
    """``add(token_id)`` per generated token, ``finish()`` at the end; ``emit(piece)`` is called
    with each non-empty piece of new text, on the caller's thread."""

    def __init__(self, decode: Callable[[list[int]], str], emit: Callable[[str], None]) -> None:
        self._decode = decode
        self._emit = emit
        self._ids: list[int] = []
        #: The text sent so far: the pieces joined.
        self.sent = ""

    def add(self, token_id: int) -> None:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith(_INCOMPLETE):
            return
        self._advance(text.strip())

    def finish(self) -> None:
        """Send what was held back and belongs to the answer (a last incomplete character
        included: the answer holds it too)."""
        self._advance(self._decode(self._ids).strip())

    def _advance(self, text: str) -> None:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            piece = text[len(self.sent):]
            self.sent = text
            self._emit(piece)


@functools.lru_cache(maxsize=1)
def _criterion_class() -> type:
    from transformers import StoppingCriteria

    class StopWhenSet(StoppingCriteria):  # type: ignore[misc]
        """Ends the generation once ``event`` is set (checked after every token)."""

        def __init__(self, event: threading.Event) -> None:
            self.event = event

        def __call__(self, input_ids: torch.Tensor, _scores: Any, **kwargs: Any) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool,
                              device=input_ids.device)

    return StopWhenSet


def stop_criteria(event: threading.Event) -> Any:
    """A ``StoppingCriteriaList`` for ``generate`` that stops once ``event`` is set."""
    from transformers import StoppingCriteriaList

    return StoppingCriteriaList([_criterion_class()(event)])
