"""The reference service's vision-language model (VLM) layer, in four rooms and a hallway.

One object, :class:`VLM`, answers "this image, this question" with timings the service exports: time
to first token, prefill and decode time, token counts, peak GPU memory. :func:`load_vlm` makes it
from :class:`~mrc_agent.reference_service.settings.Settings`:

* no ``--model``: the *embedded* model, a tiny ``LlavaForConditionalGeneration`` (CLIP vision
  tower + Llama text model) with a byte-level BPE tokenizer trained here with ``tokenizers``.
  Random weights from a fixed seed, built on first run into ``cache_dir/embedded-llava-tiny``
  and loaded from there afterwards. Its answers are NOT meaningful: ``VLM.meaningful`` is
  ``False``.
* ``--model PATH``: a local checkpoint through the transformers Auto classes, never a download.
* ``--quantize nf4``: bitsandbytes 4-bit NF4 with double quantisation (CPU or CUDA).

The rooms, one concern each (an arrow means "imports"):

* :mod:`~mrc_agent.reference_service.model.attention`: which SDPA kernel the model really runs,
observed
  with the PyTorch profiler during one short generation (probed when the profiler is busy), and
  the warning when CUDA falls back to the slow math kernel.
* :mod:`~mrc_agent.reference_service.model.embedded`: the embedded model's recipe, its in-process
  tokenizer and the crash-safe build into the cache directory.
* :mod:`~mrc_agent.reference_service.model.generation`: the :class:`VLM` object (tokenisation with
  truncation, greedy generation, the first-token clock) and :class:`GenerationResult`.
* :mod:`~mrc_agent.reference_service.model.loading`: :func:`load_vlm`, from settings to a ready VLM:
  device, dtype, NF4, checkpoint checks and naming. loading → generation, embedded, attention;
  generation → attention.

The hallway, :mod:`~mrc_agent.reference_service.model.common`, holds what several rooms share
(:class:`ModelLoadError`, the progress callback type, CLIP normalisation defaults) and imports none
of them, so there is no import cycle.

Everything callers use is re-exported here: import from ``reference_service.model``.
"""

from __future__ import annotations

from mrc_agent.reference_service.model.attention import (
    ATTENTION_BACKENDS,
    SDPA_KERNEL_OPS,
    SDPA_OP,
    AttentionReport,
    attention_warning,
    backend_counts_from_ops,
    choose_backend,
    detect_attention_backend,
    probe_sdpa_backend,
    sdpa_priority_order,
)
from mrc_agent.reference_service.model.common import ModelLoadError, Progress
from mrc_agent.reference_service.model.embedded import (
    EMBEDDED_DIRNAME,
    EMBEDDED_FORMAT,
    EMBEDDED_IMAGE_SIZE,
    EMBEDDED_MARKER,
    EMBEDDED_MODEL_ID,
    EMBEDDED_NOTE,
    EMBEDDED_PATCH_SIZE,
    EMBEDDED_SEED,
    EMBEDDED_TEXT,
    EMBEDDED_VISION,
    build_tokenizer,
    ensure_embedded,
)
from mrc_agent.reference_service.model.generation import (
    FALLBACK_TEMPLATE,
    VLM,
    GenerationResult,
    ModelInfo,
)
from mrc_agent.reference_service.model.loading import (
    NF4_SKIP_MODULES,
    load_vlm,
    nf4_config,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "EMBEDDED_DIRNAME",
    "EMBEDDED_FORMAT",
    "EMBEDDED_IMAGE_SIZE",
    "EMBEDDED_MARKER",
    "EMBEDDED_MODEL_ID",
    "EMBEDDED_NOTE",
    "EMBEDDED_PATCH_SIZE",
    "EMBEDDED_SEED",
    "EMBEDDED_TEXT",
    "EMBEDDED_VISION",
    "FALLBACK_TEMPLATE",
    "NF4_SKIP_MODULES",
    "SDPA_KERNEL_OPS",
    "SDPA_OP",
    "VLM",
    "AttentionReport",
    "GenerationResult",
    "ModelInfo",
    "ModelLoadError",
    "Progress",
    "attention_warning",
    "backend_counts_from_ops",
    "build_tokenizer",
    "choose_backend",
    "detect_attention_backend",
    "ensure_embedded",
    "load_vlm",
    "nf4_config",
    "probe_sdpa_backend",
    "resolve_device",
    "resolve_dtype",
    "sdpa_priority_order",
]
