"""Loading: settings in, a ready :class:`~mrc_agent.reference_service.model.generation.VLM` out.

:func:`load_vlm` resolves the device and dtype, takes the embedded model (built on first run by
:mod:`~mrc_agent.reference_service.model.embedded`) or a local ``--model`` checkpoint through the
transformers Auto classes (never a download), optionally quantises it to bitsandbytes NF4 with
double quantisation, names its revision, and finds out which attention kernel it runs
(:mod:`~mrc_agent.reference_service.model.attention`). Every failure is a :class:`ModelLoadError`
with a one-line reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mrc_agent.reference_service.model.attention import attention_warning
from mrc_agent.reference_service.model.common import ModelLoadError, Progress, _quiet_transformers
from mrc_agent.reference_service.model.embedded import (
    EMBEDDED_MARKER,
    EMBEDDED_NOTE,
    ensure_embedded,
)
from mrc_agent.reference_service.model.generation import VLM
from mrc_agent.reference_service.settings import Settings

#: One logger for the whole model layer, named as it was before the package split.
logger = logging.getLogger(__name__)

#: Modules kept out of NF4: the vision tower and projector are small next to the language
#: model but sensitive to 4-bit error (their output feeds every text token), and the lm_head
#: is the usual bitsandbytes exception. transformers 5 matches these patterns against full
#: module names from the start, as a regex or as a suffix; the ``.*`` forms catch
#: ``model.vision_tower...``, the plain forms keep older (substring) matching working.
NF4_SKIP_MODULES = [
    "lm_head",
    "vision_tower", r".*vision_tower",
    "multi_modal_projector", r".*multi_modal_projector",
    "vision_model", r".*vision_model",
]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


def resolve_device(requested: str) -> str:
    """``auto`` → ``cuda:N`` when CUDA is available, else ``cpu``; checks explicit choices."""
    req = (requested or "auto").strip().lower()
    if req == "auto":
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    if req == "cpu":
        return "cpu"
    if req == "cuda" or re.fullmatch(r"cuda:\d+", req):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {requested!r} requested but CUDA is not available")
        index = int(req.split(":")[1]) if ":" in req else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {requested!r}: only {torch.cuda.device_count()} "
                                 "CUDA device(s)")
        return f"cuda:{index}"
    raise ModelLoadError(f"unknown device {requested!r} (auto, cpu, cuda or cuda:N)")


def resolve_dtype(requested: str, device: str) -> torch.dtype:
    """``auto`` → float16 on CUDA, float32 on CPU."""
    req = (requested or "auto").strip().lower()
    if req == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    if req not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {requested!r} (auto, float32, float16, bfloat16)")
    return _DTYPES[req]


def nf4_config(compute_dtype: torch.dtype) -> Any:
    """The NF4 quantisation config: 4-bit NormalFloat, double quantisation, vision kept whole."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=list(NF4_SKIP_MODULES))


def _checkpoint_revision(path: Path) -> str:
    """A stable id for the checkpoint's content (the HF snapshot hash when it has one).

    Full-content hashing is kept for small checkpoints; big ones hash weight names and sizes,
    so startup never reads gigabytes just to name them.
    """
    parts = path.resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", parts[-1]):
        return parts[-1][:12]
    h = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    weights = sorted(p for p in path.iterdir()
                     if p.suffix in (".safetensors", ".bin", ".pt", ".gguf") and p.is_file())
    small = sum(p.stat().st_size for p in weights) <= 64 * 1024 * 1024
    for p in weights:
        h.update(p.name.encode())
        if small:
            h.update(p.read_bytes())
        else:
            h.update(str(p.stat().st_size).encode())
    return "local-" + h.hexdigest()[:12]


def _model_id_for(path: Path) -> str:
    """``org/name`` for a Hugging Face cache snapshot, else the directory name."""
    parts = path.resolve().parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/")
    return path.resolve().name


def _auto_model_classes(config: Any) -> list[Any]:
    """Model classes to try, most general first; ``AutoModelForVision2Seq`` is gone in 5.x."""
    import transformers

    classes = [getattr(transformers, name) for name in
               ("AutoModelForImageTextToText", "AutoModelForVision2Seq")
               if hasattr(transformers, name)]
    if getattr(config, "model_type", None) == "llava":
        classes.append(transformers.LlavaForConditionalGeneration)
    return classes


def load_vlm(settings: Settings, progress: Progress | None = None) -> VLM:
    """Load the configured model (building the embedded one on first run) and detect attention.

    Raises :class:`ModelLoadError` with a one-line reason for a missing path, an unsupported
    checkpoint, an unavailable device or quantisation library, or limits that cannot fit.
    """
    say = progress or (lambda _msg: None)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    quant = (settings.quantize or "none").strip().lower()
    if quant not in ("none", "nf4"):
        raise ModelLoadError(f"unknown quantization {settings.quantize!r} (only nf4)")

    if settings.model is None:
        path = ensure_embedded(Path(settings.cache_dir), say)
        say(f"loading embedded model from {path}")
    else:
        path = Path(settings.model).expanduser()
        if not path.exists():
            raise ModelLoadError(f"--model {settings.model}: no such directory")
        if not path.is_dir():
            raise ModelLoadError(f"--model {settings.model}: not a directory (pass the checkpoint "
                                 "directory holding config.json)")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"--model {settings.model}: no config.json, not a transformers "
                                 "checkpoint directory")
        say(f"loading {path}")

    marker: dict[str, Any] = {}
    if (path / EMBEDDED_MARKER).is_file():
        with contextlib.suppress(OSError, ValueError):
            marker = json.loads((path / EMBEDDED_MARKER).read_text())
    meaningful = bool(marker.get("meaningful", True))
    model_id = str(marker.get("model_id") or _model_id_for(path))

    model, processor = _load_checkpoint(path, settings, device, dtype, quant, say)
    vlm = VLM(model=model, processor=processor, settings=settings, device=device, dtype=dtype,
              quantization=_quantization_of(model, quant), model_id=model_id,
              revision=_checkpoint_revision(path), meaningful=meaningful, model_dir=path)
    if not meaningful:
        logger.warning("model %s: %s", model_id, marker.get("note", EMBEDDED_NOTE))

    say("detecting the attention kernel in use")
    try:
        report = vlm.detect_attention()
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise ModelLoadError(f"{path}: the model loaded but a first generation failed "
                             f"(unsupported checkpoint?): {exc}") from exc
    message = attention_warning(device, report)
    if message:
        logger.warning("%s", message)
    logger.info("model %s rev %s on %s (%s, quantization %s): attention %s (%s, %s)",
                model_id, vlm.info.revision, device, vlm.info.dtype, quant, report.backend,
                report.method, report.counts)
    say(f"model ready: {model_id} on {device}, attention {report.backend}")
    return vlm


def _load_checkpoint(path: Path, settings: Settings, device: str, dtype: torch.dtype,
                     quant: str, say: Progress) -> tuple[Any, Any]:
    """(model, processor) from a local directory, through the Auto classes; no network."""
    from transformers import AutoConfig, AutoProcessor

    common: dict[str, Any] = dict(local_files_only=True,
                                  trust_remote_code=settings.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, **common)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: cannot read the model config: {_one_line(exc)}") from exc
    try:
        with _quiet_transformers():
            processor = AutoProcessor.from_pretrained(path, **common)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: cannot load a processor (tokenizer + image processor): "
                             f"{_one_line(exc)}") from exc
    if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
        raise ModelLoadError(f"{path}: unsupported checkpoint: {type(processor).__name__} is not "
                             "an image+text processor")

    kwargs: dict[str, Any] = dict(common, dtype=dtype)
    if quant == "nf4":
        _require_bitsandbytes()
        say("quantizing to NF4 (bitsandbytes, double quantization)")
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = {"": device}
    elif device != "cpu":
        kwargs["device_map"] = {"": device}

    errors = []
    model = None
    for cls in _auto_model_classes(config):
        try:
            with _quiet_transformers():
                model = cls.from_pretrained(path, **kwargs)
            break
        except (ValueError, KeyError) as exc:  # "Unrecognized configuration class ..."
            errors.append(f"{cls.__name__}: {_one_line(exc)}")
        except (OSError, RuntimeError, ImportError) as exc:
            raise ModelLoadError(f"{path}: loading the weights failed: {_one_line(exc)}") from exc
    if model is None:
        raise ModelLoadError(f"{path}: unsupported checkpoint (model_type "
                             f"{getattr(config, 'model_type', '?')!r} is not an image-text-to-text "
                             f"model here): {'; '.join(errors)}")
    if quant == "none" and device == "cpu":
        model = model.to(device)
    model.eval()
    return model, processor


def _quantization_of(model: Any, requested: str) -> str:
    """The quantisation really loaded: a pre-quantised checkpoint is one without --quantize."""
    if requested != "none":
        return requested
    qc = getattr(model.config, "quantization_config", None)
    if qc is None:
        return "none"
    qc = qc if isinstance(qc, Mapping) else qc.to_dict()
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        return str(qc.get("bnb_4bit_quant_type") or "4bit")
    return str(qc.get("quant_method") or "quantized")


def _require_bitsandbytes() -> None:
    for name in ("bitsandbytes", "accelerate"):
        try:
            __import__(name)
        except ImportError as exc:
            raise ModelLoadError(f"--quantize nf4 needs the {name} package: {exc}") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400]
