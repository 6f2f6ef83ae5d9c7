"""What the model layer's rooms share: the load error, the progress callback, CLIP defaults.

Kept apart so that :mod:`~mrc_agent.reference_service.model.embedded`,
:mod:`~mrc_agent.reference_service.model.loading` and
:mod:`~mrc_agent.reference_service.model.generation` can all use these without importing each other.
Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

#: Called with one line per load step ("training tokenizer ...", "loading ..."): the CLI's
#: progress display and the service's ``/health`` "loading" field.
Progress = Callable[[str], None]

#: CLIP's normalisation: the embedded model's image processor, and the fallback for a
#: checkpoint whose image processor does not say.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ModelLoadError(RuntimeError):
    """The model could not be loaded or built; the message says why in one line."""


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' tqdm bars while loading/saving: the CLI draws its own progress."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
