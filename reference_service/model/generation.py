"""Generation: the loaded model object, :class:`VLM`, and what one answer costs.

``VLM.generate(pixel_values, prompt, max_new_tokens)`` answers "this image, this question" greedily
and returns a :class:`GenerationResult` with the timings the service exports: time to first token
(clocked by a streamer ``generate`` calls synchronously, which also hands a streamed answer's text
on as it is made: :mod:`~mrc_agent.reference_service.model.streaming`), prefill and decode time,
why it ended, token counts,
peak GPU memory (process-wide, with how many other requests shared the device meanwhile:
:func:`~mrc_agent.reference_service.device.peak_memory`). ``pixel_values`` arrive already resized
and normalised (the preprocessing module uses ``image_size``, ``image_mean`` and ``image_std`` from
here); this module only moves them to the model's device and dtype. At construction the VLM reads
from the checkpoint what it needs (image size and token, chat template, input limit); it is built by
:func:`~mrc_agent.reference_service.model.loading.load_vlm`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mrc_agent.reference_service.device import CudaAPI, DeviceUsers, peak_memory
from mrc_agent.reference_service.model.attention import (
    AttentionReport,
    _attn_implementation,
    detect_attention_backend,
    probe_sdpa_backend,
)
from mrc_agent.reference_service.model.common import _CLIP_MEAN, _CLIP_STD, ModelLoadError
from mrc_agent.reference_service.model.streaming import TextPieces, stop_criteria
from mrc_agent.reference_service.settings import Settings

#: One logger for the whole model layer, named as it was before the package split.
logger = logging.getLogger(__name__)

#: Fallback prompt format when a checkpoint has no chat template (llava-1.5 style).
FALLBACK_TEMPLATE = "USER: {image}\n{prompt} ASSISTANT:"


@dataclass
class ModelInfo:
    """What the info metric and ``/health`` say about the loaded model."""

    model_id: str
    revision: str
    dtype: str
    quantization: str
    device: str
    attention_backend: str


@dataclass
class GenerationResult:
    """One answer and what it cost.

    ``ttft_s`` runs from the call to :meth:`VLM.generate` (waiting for the model lock and
    tokenisation included) to the first generated token; ``prefill_s`` from the start of the
    model's ``generate`` to that token; ``generate_s`` from there to the last token.
    """

    text: str
    input_tokens: int
    output_tokens: int
    ttft_s: float
    prefill_s: float
    generate_s: float
    #: Peak of the process's allocated GPU memory during this generation: weights, this
    #: request's activations and KV cache, and whatever other requests held meanwhile (None
    #: off CUDA).
    peak_gpu_memory_bytes: int | None
    truncated: bool
    #: Other requests with work or tensors on the device during that peak's window: 0 means
    #: the peak is this request's own (None off CUDA).
    peak_gpu_memory_shared_with: int | None = None
    #: Why the answer ended, in the OpenAI API's words: "stop" (the model's end-of-sequence
    #: token), "length" (``max_new_tokens`` reached) or "abort" (``stop`` was set).
    finish_reason: str = "stop"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _FirstTokenClock:
    """A generate() streamer that notes when the first new token arrives and, for a streamed
    answer, hands each token on to its :class:`TextPieces`.

    generate() calls ``put`` synchronously (no thread): once with the prompt, then once per
    step with the chosen token, already copied to the CPU (so on CUDA the time is real).
    """

    def __init__(self, on_first_token: Callable[[], None] | None = None,
                 pieces: TextPieces | None = None) -> None:
        self.calls = 0
        self.first_token_at: float | None = None
        self.on_first_token = on_first_token
        self.pieces = pieces

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            if self.on_first_token is not None:
                # The request's own clock (its TTFT metric) is marked at the same moment.
                self.on_first_token()
        if self.calls >= 2 and self.pieces is not None:
            for token in value.reshape(-1).tolist():
                self.pieces.add(int(token))

    def end(self) -> None:
        if self.pieces is not None:
            self.pieces.finish()


@functools.lru_cache(maxsize=1)
def _streamer_class() -> type:
    try:
        from transformers.generation.streamers import BaseStreamer
    except ImportError:
        return _FirstTokenClock
    return type("FirstTokenClock", (_FirstTokenClock, BaseStreamer), {})


class VLM:
    """A loaded vision-language model: ``generate(pixel_values, prompt, max_new_tokens)``.

    Concurrency: calls are serialised by a lock. PyTorch modules in eval mode could run
    concurrently, but on one GPU two generations only compete for the same SMs and memory
    (and double the KV-cache peak), on CPU for the same intra-op threads, and transformers'
    generate and fast tokenizers are not documented as thread-safe. The service's own
    concurrency limit queues requests in front; the time spent waiting here is counted in
    ``ttft_s``.
    """

    def __init__(self, *, model: Any, processor: Any, settings: Settings, device: str,
                 dtype: torch.dtype, quantization: str, model_id: str, revision: str,
                 meaningful: bool, model_dir: Path, cuda: CudaAPI = torch.cuda) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        # Truncation is ours (by token budget, below); the tokenizer's "longer than the maximum"
        # warning would only fire on the long prompts that encode() is about to cut.
        self.tokenizer.model_max_length = int(1e30)
        self.device = device
        self.dtype = dtype
        self.meaningful = meaningful
        self.model_dir = model_dir
        self.warmed = False
        self._lock = threading.Lock()
        #: Requests holding work or tensors on ``device``: the pipeline occupies it around
        #: preprocessing and generation, so a peak-memory reading knows who shared it.
        self.device_users = DeviceUsers()
        self._cuda = cuda
        config = model.config
        self.image_size: tuple[int, int] = self._find_image_size(config, processor)
        ip = processor.image_processor
        self.image_mean: tuple[float, float, float] = _triple(getattr(ip, "image_mean", None),
                                                              _CLIP_MEAN)
        self.image_std: tuple[float, float, float] = _triple(getattr(ip, "image_std", None),
                                                             _CLIP_STD)
        self.image_token: str = str(getattr(processor, "image_token", None) or "<image>")
        self.image_token_id: int = self._find_image_token_id(config)
        self.num_image_tokens: int = self._find_num_image_tokens(config)
        self._prefix, self._suffix = self._prompt_frame()
        self._add_special = not self._prefix.startswith(str(self.tokenizer.bos_token or "\0"))
        self.max_input_tokens: int = self._input_limit(settings)
        self.pad_token_id = self._find_pad_id()
        self._eos_ids = self._find_eos_ids()
        self.cpu_threads_hint: int | None = self._cpu_threads_hint()
        self.attention: AttentionReport | None = None
        self.info = ModelInfo(model_id=model_id, revision=revision, dtype=_dtype_name(dtype),
                              quantization=quantization, device=device,
                              attention_backend="unknown")

    # ----- introspection at load -----

    @property
    def attention_backend(self) -> str:
        return self.info.attention_backend

    @staticmethod
    def _find_image_size(config: Any, processor: Any) -> tuple[int, int]:
        vision = getattr(config, "vision_config", None)
        size = getattr(vision, "image_size", None)
        if isinstance(size, int):
            return (size, size)
        if isinstance(size, (list, tuple)) and len(size) == 2:
            return (int(size[0]), int(size[1]))
        ip = processor.image_processor
        for attr in ("crop_size", "size"):
            value = getattr(ip, attr, None)
            value = value if isinstance(value, Mapping) else getattr(value, "__dict__", {})
            if value.get("height") and value.get("width"):
                return (int(value["height"]), int(value["width"]))
            if value.get("shortest_edge"):
                return (int(value["shortest_edge"]), int(value["shortest_edge"]))
        raise ModelLoadError("unsupported checkpoint: cannot tell the vision tower's input size")

    def _find_image_token_id(self, config: Any) -> int:
        ids = self.tokenizer.convert_tokens_to_ids(self.image_token)
        from_tokenizer = ids if isinstance(ids, int) else None
        from_config = getattr(config, "image_token_id", None)
        if from_config is None:
            from_config = getattr(config, "image_token_index", None)
        if from_config is None and from_tokenizer is None:
            raise ModelLoadError("unsupported checkpoint: no image token in config or tokenizer")
        if from_config is not None and from_tokenizer is not None and from_config != from_tokenizer:
            raise ModelLoadError(f"checkpoint inconsistent: image token {self.image_token!r} is id "
                                 f"{from_tokenizer} in the tokenizer, {from_config} in the config")
        chosen = from_config if from_config is not None else from_tokenizer
        assert chosen is not None
        return int(chosen)

    def _find_num_image_tokens(self, config: Any) -> int:
        """How many placeholder tokens one image of ``image_size`` expands to."""
        h, w = self.image_size
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is not None:
            with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
                n = counter(image_sizes=[[h, w]]).num_image_tokens
                if n and int(n[0]) > 0:
                    return int(n[0])
        vision = getattr(config, "vision_config", None)
        patch = getattr(vision, "patch_size", None)
        if getattr(config, "model_type", None) == "llava" and patch:
            n = (h // patch) * (w // patch)  # + CLS, - CLS for the "default" strategy
            if getattr(config, "vision_feature_select_strategy", "default") == "full":
                n += 1
            return n
        raise ModelLoadError(f"unsupported checkpoint ({getattr(config, 'model_type', '?')}): "
                             "cannot tell how many tokens an image expands to")

    def _prompt_frame(self) -> tuple[str, str]:
        """The text before and after the user's prompt, from the chat template or the fallback."""
        sentinel = "\u2063MRC_PROMPT\u2063"
        conversation = [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": sentinel}]}]
        for owner in (self.processor, self.tokenizer):
            if not getattr(owner, "chat_template", None):
                continue
            try:
                rendered = owner.apply_chat_template(conversation, add_generation_prompt=True,
                                                     tokenize=False)
            except (ValueError, TypeError, KeyError) as exc:
                logger.info("chat template of %s unusable (%s)", type(owner).__name__, exc)
                continue
            if isinstance(rendered, list):
                rendered = rendered[0] if rendered else ""
            if rendered.count(sentinel) == 1 and rendered.count(self.image_token) == 1:
                prefix, suffix = rendered.split(sentinel)
                return prefix, suffix
        prefix, suffix = FALLBACK_TEMPLATE.format(image=self.image_token, prompt=sentinel)\
            .split(sentinel)
        return prefix, suffix

    def _input_limit(self, settings: Settings) -> int:
        """Input tokens allowed: the setting, capped so input + max new tokens fit positions."""
        text_config = getattr(self.model.config, "text_config", self.model.config)
        max_pos = getattr(text_config, "max_position_embeddings", None)
        limit = int(settings.max_input_tokens)
        if max_pos:
            limit = min(limit, int(max_pos) - int(settings.max_new_tokens_limit))
        floor = len(self._encode_frame("")) + 1
        if limit < floor:
            raise ModelLoadError(
                f"max_input_tokens {settings.max_input_tokens} leaves no room for a prompt: the "
                f"image ({self.num_image_tokens} tokens) and template need {floor - 1} alone "
                f"(max positions {max_pos}, max new tokens {settings.max_new_tokens_limit})")
        return limit

    def _cpu_threads_hint(self) -> int | None:
        """Intra-op CPU threads this model runs best with, for the process owner to apply.

        ``torch.set_num_threads`` is process-wide, so this module never calls it. A model as
        small as the embedded one (hidden size 128) gains nothing from splitting each matmul
        across threads, and when the CPU is shared the threads wait on each other at every
        op: on a busy 2-core machine one thread was up to 30x faster than two, on a quiet one
        no slower.
        """
        if self.device != "cpu":
            return None
        text_config = getattr(self.model.config, "text_config", self.model.config)
        hidden = getattr(text_config, "hidden_size", None)
        return 1 if isinstance(hidden, int) and hidden <= 256 else None

    def _find_eos_ids(self) -> frozenset[int]:
        """Every id that ends a generation: the generation config's (one or a list) and the
        tokenizer's."""
        found: set[int] = set()
        for value in (getattr(self.model.generation_config, "eos_token_id", None),
                      self.tokenizer.eos_token_id):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int):
                    found.add(v)
        return frozenset(found)

    def _find_pad_id(self) -> int | None:
        for value in (self.tokenizer.pad_token_id,
                      getattr(self.model.generation_config, "pad_token_id", None),
                      self.tokenizer.eos_token_id):
            if isinstance(value, int):
                return value
        return None

    # ----- tokenisation -----

    def _encode_frame(self, prompt: str) -> list[int]:
        """Token ids of the framed prompt with the one image placeholder expanded."""
        ids = self.tokenizer(self._prefix + prompt + self._suffix,
                             add_special_tokens=self._add_special, padding=False,
                             truncation=False)["input_ids"]
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != 1:
            raise ValueError(f"prompt must hold exactly one image placeholder, found {len(at)}")
        return ids[:at[0]] + [self.image_token_id] * self.num_image_tokens + ids[at[0] + 1:]

    def encode(self, prompt: str) -> tuple[list[int], bool]:
        """(input ids, truncated): at most ``max_input_tokens`` ids, never padded.

        The user's text is cut at a token boundary (by character offset, so the template's
        closing "ASSISTANT:" survives and no character is split), never the image or template.
        """
        # The image placeholder in the user's text would desynchronise image features.
        prompt = prompt.replace(self.image_token, " ")
        ids = self._encode_frame(prompt)
        if len(ids) <= self.max_input_tokens:
            return ids, False
        enc = self.tokenizer(prompt, add_special_tokens=False, padding=False, truncation=False,
                             return_offsets_mapping=True)
        offsets = enc.get("offset_mapping")
        overhead = len(ids) - len(enc["input_ids"])
        budget = self.max_input_tokens - overhead
        for _ in range(8):
            budget = max(0, budget)
            if offsets and budget < len(offsets):
                cut = offsets[budget - 1][1] if budget > 0 else 0
            else:
                cut = len(prompt) * budget // max(1, len(enc["input_ids"]))
            ids = self._encode_frame(prompt[:cut])
            over = len(ids) - self.max_input_tokens
            if over <= 0:
                return ids, True
            budget -= over
        ids = self._encode_frame("")
        return ids, True

    # ----- generation -----

    def generate(self, pixel_values: torch.Tensor, prompt: str, max_new_tokens: int,
                 on_first_token: Callable[[], None] | None = None,
                 device_user: int | None = None,
                 on_text: Callable[[str], None] | None = None,
                 stop: threading.Event | None = None) -> GenerationResult:
        """Greedy answer to ``prompt`` about the image in ``pixel_values`` ([1, 3, H, W]).

        ``on_first_token`` is called (on this thread) when the first new token exists.
        ``device_user`` is the caller's token from ``device_users.occupy()``, so that the peak
        memory reading does not count the request itself as another user of the device.
        ``on_text`` streams the answer: it is called (on this thread) with each new piece of its
        text, the pieces joined being the result's ``text``. Setting ``stop`` ends the
        generation after the token being made (``finish_reason`` "abort").
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        shape = tuple(pixel_values.shape)
        if len(shape) != 4 or shape[0] != 1 or shape[1] != 3 or shape[2:] != self.image_size:
            raise ValueError(f"pixel_values must be [1, 3, {self.image_size[0]}, "
                             f"{self.image_size[1]}], got {list(shape)}")
        entered = time.perf_counter()
        with self._lock:
            ids, truncated = self.encode(prompt)
            with peak_memory(self.device, self.device_users, device_user, self._cuda) as peak:
                input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
                # Blocking copy: a non-blocking GPU-to-CPU copy could be read before it lands.
                pixels = pixel_values.to(device=self.device, dtype=self.dtype)
                pieces = None if on_text is None else TextPieces(self._decode, on_text)
                clock = _streamer_class()(on_first_token, pieces)
                extra: dict[str, Any] = {}
                if stop is not None:
                    extra["stopping_criteria"] = stop_criteria(stop)
                started = time.perf_counter()
                with torch.inference_mode():
                    out = self.model.generate(
                        input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                        pixel_values=pixels, max_new_tokens=max_new_tokens, do_sample=False,
                        num_beams=1, streamer=clock, pad_token_id=self.pad_token_id, **extra)
                new = out[0, input_ids.shape[1]:].tolist()
                finished = time.perf_counter()
        text = self._decode(new).strip() if pieces is None else pieces.sent
        first = clock.first_token_at or finished
        return GenerationResult(
            text=text, input_tokens=len(ids), output_tokens=len(new),
            ttft_s=first - entered, prefill_s=first - started, generate_s=finished - first,
            peak_gpu_memory_bytes=peak.nbytes, truncated=truncated,
            peak_gpu_memory_shared_with=peak.shared_with,
            finish_reason=self._finish_reason(new, max_new_tokens, stop))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _finish_reason(self, new: list[int], max_new_tokens: int,
                       stop: threading.Event | None) -> str:
        if new and new[-1] in self._eos_ids:
            return "stop"
        if len(new) >= max_new_tokens:
            return "length"
        return "abort" if stop is not None and stop.is_set() else "stop"

    def blank_pixels(self) -> torch.Tensor:
        """A mid-grey image, normalised: what warmup and detection feed the model."""
        h, w = self.image_size
        mean = torch.tensor(self.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std).view(1, 3, 1, 1)
        return ((torch.full((1, 3, h, w), 0.5) - mean) / std).to(self.dtype)

    def warmup(self) -> None:
        """One short generation so the first request does not pay for lazy initialisation."""
        self.generate(self.blank_pixels(), "What is in this picture?", max_new_tokens=2)
        self.warmed = True

    def detect_attention(self) -> AttentionReport:
        """Find the SDPA kernel in use (one observed generation); updates ``info``."""
        implementation = _attn_implementation(self.model.config)
        text_config = getattr(self.model.config, "text_config", self.model.config)
        heads = int(getattr(text_config, "num_attention_heads", 8))
        head_dim = int(getattr(text_config, "head_dim", None)
                       or getattr(text_config, "hidden_size", 512) // heads)

        def probe() -> tuple[str, list[str]]:
            return probe_sdpa_backend(heads, head_dim, self.dtype, self.device)

        report = detect_attention_backend(
            lambda: self.generate(self.blank_pixels(), "Hi", max_new_tokens=2),
            implementation, probe)
        if report.counts.get("math") and self.device.startswith("cuda") and not report.reasons:
            _, report.reasons = probe()
        self.attention = report
        self.info.attention_backend = report.backend
        return report


def _triple(value: Any, default: tuple[float, float, float]) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value), float(value), float(value))
    if isinstance(value, (list, tuple)) and len(value) == 3:
        return (float(value[0]), float(value[1]), float(value[2]))
    return default
