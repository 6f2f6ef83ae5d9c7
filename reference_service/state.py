"""What the service holds for its lifetime, built once in the lifespan: the model, the metrics,
the cache, OCR, admission control and the worker pools."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mrc_agent.exporters.instrumentation import MRCMetrics
from mrc_agent.reference_service.cache import AnswerCache
from mrc_agent.reference_service.limiter import Admission, BoundedStep
from mrc_agent.reference_service.ocr import OCR
from mrc_agent.reference_service.preprocess import DecodePool
from mrc_agent.reference_service.settings import Settings


@dataclass
class ServiceState:
    settings: Settings
    metrics: MRCMetrics
    cache: AnswerCache[dict[str, Any]]
    admission: Admission
    decode_pool: DecodePool
    #: Header probes, on threads of their own: a crafted header never waits behind decodes,
    #: and decodes never wait behind crafted headers.
    header_pool: DecodePool
    #: Runs generate (the model serialises calls itself) and OCR off the event loop.
    model_pool: ThreadPoolExecutor
    ocr_pool: ThreadPoolExecutor
    #: The OCR step on ``ocr_pool``'s threads, with a bounded wait for a free one.
    ocr_step: BoundedStep
    #: Anything with ``read(image, cancel=None) -> str`` raising ``OCRError`` (``cancel``: a
    #: ``threading.Event`` that ends the read); None: the step is off.
    ocr: OCR | Any | None
    vlm: Any = None  # reference_service.model.VLM once loaded (imported lazily: torch)
    loading: str = "starting"
    ready: bool = False
    load_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ocr_on(self) -> bool:
        return self.ocr is not None
