"""The reference service's vision-language model (VLM) layer.

One object, :class:`VLM`, answers "this image, this question" with timings the service exports:
time to first token, prefill and decode time, token counts, peak GPU memory. :func:`load_vlm`
makes it from :class:`~reference_service.settings.Settings`:

* no ``--model``: the *embedded* model, a tiny ``LlavaForConditionalGeneration`` (CLIP vision
  tower + Llama text model) with a byte-level BPE tokenizer trained here with ``tokenizers``.
  Random weights from a fixed seed, built on first run into ``cache_dir/embedded-llava-tiny``
  (built in a temporary directory and renamed, so a crash never leaves half a model) and loaded
  from there afterwards. Its answers are NOT meaningful: ``VLM.meaningful`` is ``False``.
* ``--model PATH``: a local checkpoint through the transformers Auto classes, never a download.
* ``--quantize nf4``: bitsandbytes 4-bit NF4 with double quantisation (CPU or CUDA).

At load it also finds out which scaled-dot-product-attention (SDPA) kernel the model really
runs on this device, by watching one short generation with the PyTorch profiler (see
:func:`detect_attention_backend`), and warns when CUDA falls back to the slow math kernel.

``pixel_values`` reach :meth:`VLM.generate` already resized and normalised (the preprocessing
module uses ``image_size``, ``image_mean`` and ``image_std`` from here); this module only moves
them to the model's device and dtype.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reference_service.settings import Settings

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

#: Directory name of the embedded model under ``settings.cache_dir``.
EMBEDDED_DIRNAME = "embedded-llava-tiny"
#: Written last into the embedded model's directory; its presence with this format number
#: means "a complete build". Bump the format when the recipe below changes, to force a rebuild.
EMBEDDED_MARKER = "mrc_embedded.json"
EMBEDDED_FORMAT = 1
EMBEDDED_MODEL_ID = "mrc-embedded/llava-tiny-random"
EMBEDDED_SEED = 0
EMBEDDED_NOTE = ("Random weights (fixed seed): this model's answers are NOT meaningful. It exists "
                 "so the service runs end to end with no download.")

#: Fallback prompt format when a checkpoint has no chat template (llava-1.5 style).
FALLBACK_TEMPLATE = "USER: {image}\n{prompt} ASSISTANT:"

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

ATTENTION_BACKENDS = ("flash", "efficient", "cudnn", "math", "overrideable", "eager", "unknown")


class ModelLoadError(RuntimeError):
    """The model could not be loaded or built; the message says why in one line."""


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
    peak_gpu_memory_bytes: int | None
    truncated: bool
    #: Time spent waiting for the model lock (another request was generating).
    queue_wait_s: float = 0.0


# --------------------------------------------------------------------------------------------
# Attention backend detection
# --------------------------------------------------------------------------------------------

#: Profiler op names of the kernels ``torch.nn.functional.scaled_dot_product_attention``
#: dispatches to. ``..._for_cpu`` is PyTorch's CPU flash-attention kernel.
SDPA_KERNEL_OPS: dict[str, str] = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
SDPA_OP = "aten::scaled_dot_product_attention"
#: Ties between backends are reported as the slower one (lower rank): a warning beats a boast.
_SPEED_RANK = {"math": 0, "unknown": 0, "overrideable": 1, "efficient": 2, "cudnn": 3, "flash": 4}


@dataclass
class AttentionReport:
    """Which SDPA kernel the model's attention ran on, and how that was found out."""

    backend: str
    #: Kernel calls seen per backend during the observed generation.
    counts: dict[str, int] = field(default_factory=dict)
    #: ``config._attn_implementation`` of the model ("sdpa", "eager", ...).
    attn_implementation: str = ""
    #: "profiler" (observed) or "probe" (the profiler was unavailable; see probe_sdpa_backend).
    method: str = "profiler"
    #: Why faster backends were refused, from PyTorch's own warnings (probe only).
    reasons: list[str] = field(default_factory=list)


def backend_counts_from_ops(op_names: Iterable[str]) -> tuple[dict[str, int], int]:
    """Count SDPA kernel calls per backend in a list of profiler op names.

    Returns ``(counts, sdpa_calls)`` where ``sdpa_calls`` counts the public
    ``aten::scaled_dot_product_attention`` entry point; calls that reached no known kernel are
    counted as ``"unknown"``.
    """
    counts: Counter[str] = Counter()
    calls = 0
    for name in op_names:
        if name == SDPA_OP:
            calls += 1
        elif name in SDPA_KERNEL_OPS:
            counts[SDPA_KERNEL_OPS[name]] += 1
    missing = calls - sum(counts.values())
    if missing > 0:
        counts["unknown"] += missing
    return dict(counts), calls


def choose_backend(counts: Mapping[str, int]) -> str:
    """The backend that ran most SDPA calls (ties: the slower one); "eager" if none ran."""
    live = {k: v for k, v in counts.items() if v > 0}
    if not live:
        return "eager"
    return max(live, key=lambda k: (live[k], -_SPEED_RANK.get(k, 0)))


def attention_warning(device: str, report: AttentionReport) -> str | None:
    """The warning to log for this report, or None: CUDA running attention on the math kernel."""
    if not device.startswith("cuda"):
        return None
    if report.counts.get("math", 0) > 0 or report.backend == "math":
        why = ("; ".join(report.reasons)) if report.reasons else "see PyTorch's SDPA warnings"
        return (f"attention falls back to the SDPA math kernel on {device} "
                f"({report.counts.get('math', 0)} of {sum(report.counts.values())} calls): "
                f"slow and memory-hungry. Why the fused kernels were refused: {why}")
    return None


def _sdpa_backend_enum(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_priority_order() -> list[str]:
    """PyTorch's SDPA backend priority order on this build (flash, efficient, math, cudnn)."""
    default = ["flash", "efficient", "math", "cudnn"]
    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    if getter is None:
        return default
    names = {1: "flash", 2: "efficient", 0: "math", 3: "cudnn"}
    try:
        order = [names[int(i)] for i in getter() if int(i) in names]
    except (RuntimeError, TypeError, ValueError):
        return default
    return order or default


def probe_sdpa_backend(num_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                       seq_len: int = 64,
                       order: list[str] | None = None) -> tuple[str, list[str]]:
    """Try each SDPA backend alone on model-shaped inputs, in PyTorch's priority order.

    Returns the first backend that runs (what the dispatcher would pick for such a call) and
    PyTorch's stated reasons for refusing the ones before it. A stand-in for observing the
    model, used when the profiler is unavailable and to explain a CUDA fallback to math.
    """
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, num_heads, seq_len, head_dim, dtype=dtype, device=device)
    reasons: list[str] = []
    for name in order or sdpa_priority_order():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([_sdpa_backend_enum(name)]), torch.inference_mode():
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            except RuntimeError as exc:
                said = [str(w.message).strip().replace("\n", " ") for w in caught]
                reasons.append(f"{name}: " + (" ".join(said) if said else str(exc))[:300])
                continue
        return name, reasons
    return "unknown", reasons


def detect_attention_backend(run: Callable[[], object], attn_implementation: str,
                             probe: Callable[[], tuple[str, list[str]]] | None = None,
                             ) -> AttentionReport:
    """Run ``run`` (one short generation) under the PyTorch profiler and report the SDPA kernel.

    The profiler records both the public ``aten::scaled_dot_product_attention`` call and the
    kernel the dispatcher chose for it, so this is what the model really ran with its real
    shapes, dtype, masks and device. No SDPA calls at all means the model computes attention
    itself ("eager"). If the profiler cannot start (another one is running), ``probe`` answers.
    """
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        names = [e.name for e in prof.events()]
    except RuntimeError as exc:
        if probe is None or attn_implementation != "sdpa":
            raise
        logger.info("profiler unavailable (%s); probing SDPA backends instead", exc)
        backend, reasons = probe()
        return AttentionReport(backend=backend, counts={backend: 1},
                               attn_implementation=attn_implementation, method="probe",
                               reasons=reasons)
    counts, _ = backend_counts_from_ops(names)
    return AttentionReport(backend=choose_backend(counts), counts=counts,
                           attn_implementation=attn_implementation, method="profiler")


# --------------------------------------------------------------------------------------------
# Embedded model recipe
# --------------------------------------------------------------------------------------------

_WORDS_TEXT = """
the a an is are was were be been being of to in on at by for with from about into over under
and or but not no yes this that these those it its there here what which who whom whose how
why where when can could should would will may might must do does did done have has had
i you he she we they me him her us them my your his our their one two three four five six
seven eight nine ten first last next many much more most some any all each every other
photo image picture parcel package box envelope label sticker barcode text letter number
damage damaged broken torn crushed wet dirty open opened sealed tape corner side front back
top bottom left right middle red green blue black white brown yellow orange gray grey color
small large big little long short wide narrow heavy light new old good bad clear blurry
see look show shows shown read write find count describe answer question please thank
person people hand table floor door window wall road car truck street house room shelf
address name city country code date time day week month year today yesterday tomorrow
shipping delivery delivered return sender receiver weight size price total item items
because so if then than also only just very too again still already never always often
"""
_EXTRA_TEXT = ("USER ASSISTANT SYSTEM Image Photo The A What Is Are How Why Where When Which Who "
               "Yes No OK 0 1 2 3 4 5 6 7 8 9 10 12 24 50 100 365 1000 2024 2025 . , ; : ! ? ' \" "
               "( ) [ ] - _ / % & + = * # @ $")
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n{% endif %}"
    "{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %} "
    "{% else %}ASSISTANT: "
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}</s>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

#: Sizes of the embedded model: small enough that a CPU forward pass takes milliseconds, of a
#: real shape all the same (CLIP ViT with CLS token, Llama with grouped-query attention).
EMBEDDED_IMAGE_SIZE = 224
EMBEDDED_PATCH_SIZE = 16  # 14 x 14 = 196 image tokens (CLS dropped, llava "default" strategy)
EMBEDDED_VISION: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, projection_dim=128)
EMBEDDED_TEXT: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _corpus() -> list[str]:
    """A deterministic small English corpus: every word in a few contexts, digits, punctuation."""
    words = _WORDS_TEXT.split()
    lines = []
    n = len(words)
    for step in (1, 3, 7, 11):
        lines.append(" ".join(words[(i * step) % n] for i in range(n)))
    for i in range(0, n, 8):
        chunk = words[i:i + 8]
        lines.append(" ".join(chunk).capitalize() + "?")
        lines.append("The " + ", ".join(chunk) + ".")
    lines.append(_EXTRA_TEXT + "\n" + _EXTRA_TEXT.replace(" ", ""))
    return lines


def build_tokenizer() -> Any:
    """Train the embedded model's byte-level BPE tokenizer here; a transformers fast tokenizer.

    Byte-level: any UTF-8 prompt (Chinese, emoji) encodes without an unknown token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", extra_special_tokens={"image_token": "<image>"},
        model_max_length=EMBEDDED_TEXT["max_position_embeddings"])


def _suppressed_token_ids(tokenizer: Any) -> list[int]:
    """Tokens the embedded model may not generate.

    Those that decode to nothing printable alone (lone UTF-8 bytes, control bytes, specials):
    the random model would otherwise happily emit them and its "answer" would be mojibake. And
    end-of-sequence: a random model's answer length means nothing, so it always runs to
    ``max_new_tokens``, which makes the load it puts on the service predictable.
    """
    out = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if token_id in tokenizer.all_special_ids or not text or "\ufffd" in text or \
                not all(ch.isprintable() or ch in " \n" for ch in text):
            out.append(token_id)
    return sorted(set(out))


def _build_embedded(target: Path, progress: Progress) -> None:
    """Build the embedded model into a temporary sibling of ``target``, then rename it there."""
    progress("importing transformers model classes")
    from transformers import (
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-{os.getpid()}-", dir=target.parent))
    try:
        progress("training tokenizer (byte-level BPE)")
        tokenizer = build_tokenizer()
        image_token_id = tokenizer.convert_tokens_to_ids("<image>")
        image_processor = _clip_image_processor()
        processor = LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=EMBEDDED_PATCH_SIZE,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=_CHAT_TEMPLATE)
        num_image_tokens = (EMBEDDED_IMAGE_SIZE // EMBEDDED_PATCH_SIZE) ** 2
        vision = CLIPVisionConfig(image_size=EMBEDDED_IMAGE_SIZE, patch_size=EMBEDDED_PATCH_SIZE,
                                  **EMBEDDED_VISION)
        text = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, **EMBEDDED_TEXT)
        # Recorded in config.json too, so whoever opens the checkpoint is told.
        flags: dict[str, Any] = {"mrc_random_weights": True, "mrc_note": EMBEDDED_NOTE}
        config = LlavaConfig(
            vision_config=vision, text_config=text, image_token_index=image_token_id,
            image_seq_length=num_image_tokens, vision_feature_layer=-2,
            vision_feature_select_strategy="default", **flags)
        progress(f"initialising LlavaForConditionalGeneration with random weights "
                 f"(seed {EMBEDDED_SEED})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(EMBEDDED_SEED)
            model = LlavaForConditionalGeneration(config).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, do_sample=False,
            suppress_tokens=_suppressed_token_ids(tokenizer))
        progress("saving embedded model")
        with _quiet_transformers():
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
        params = sum(p.numel() for p in model.parameters())
        marker = {"format": EMBEDDED_FORMAT, "model_id": EMBEDDED_MODEL_ID, "meaningful": False,
                  "note": EMBEDDED_NOTE, "seed": EMBEDDED_SEED, "parameters": params,
                  "architecture": "LlavaForConditionalGeneration (CLIP vision + Llama text)"}
        # The marker goes in last: a directory without it is not a finished build.
        (tmp / EMBEDDED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _embedded_ready(target):
                raise
            logger.info("another process finished building %s first; using theirs", target)
            shutil.rmtree(tmp, ignore_errors=True)
        progress(f"embedded model built: {params / 1e6:.2f} M parameters in {target}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _clip_image_processor() -> Any:
    """A CLIP image processor config (the PIL one: torchvision is not installed here)."""
    kwargs: dict[str, Any] = dict(
        size={"shortest_edge": EMBEDDED_IMAGE_SIZE},
        crop_size={"height": EMBEDDED_IMAGE_SIZE, "width": EMBEDDED_IMAGE_SIZE},
        image_mean=list(_CLIP_MEAN), image_std=list(_CLIP_STD))
    try:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        return CLIPImageProcessorPil(**kwargs)
    except ImportError:  # older transformers: the plain class is the PIL one
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor(**kwargs)


def _remove_stale_builds(target: Path) -> None:
    """Delete temporary build directories left by processes that died mid-build."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.build-(\d+)-")
    for entry in target.parent.iterdir():
        m = pattern.match(entry.name)
        if not m or not entry.is_dir():
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue  # a build in progress (ours in another thread, or another process's)
        logger.info("removing stale partial build %s", entry)
        shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _embedded_ready(path: Path) -> bool:
    try:
        marker = json.loads((path / EMBEDDED_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == EMBEDDED_FORMAT


def ensure_embedded(cache_dir: Path, progress: Progress | None = None) -> Path:
    """The embedded model's directory, built first if it is missing, partial or outdated."""
    say = progress or (lambda _msg: None)
    target = Path(cache_dir).expanduser() / EMBEDDED_DIRNAME
    if _embedded_ready(target):
        return target
    if target.exists():
        # An outdated format (the recipe changed): move it aside, then build afresh.
        say(f"embedded model in {target} is outdated; rebuilding")
        aside = target.with_name(f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError as exc:
            raise ModelLoadError(f"cannot replace outdated embedded model {target}: {exc}") from exc
    say(f"building the embedded model (first run) in {target}")
    started = time.monotonic()
    try:
        _build_embedded(target, say)
    except ModelLoadError:
        raise
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"could not build the embedded model in {target}: {exc}") from exc
    logger.info("built embedded model in %s in %.2f s", target, time.monotonic() - started)
    return target


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


# --------------------------------------------------------------------------------------------
# The model object
# --------------------------------------------------------------------------------------------

class _FirstTokenClock:
    """A generate() streamer that only notes when the first new token arrives.

    generate() calls ``put`` synchronously (no thread): once with the prompt, then once per
    step with the chosen token, already copied to the CPU (so on CUDA the time is real).
    """

    def __init__(self, on_first_token: Callable[[], None] | None = None) -> None:
        self.calls = 0
        self.first_token_at: float | None = None
        self.on_first_token = on_first_token

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            if self.on_first_token is not None:
                # The request's own clock (its TTFT metric) is marked at the same moment.
                self.on_first_token()

    def end(self) -> None:
        pass


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
    concurrency limit queues requests in front; the time spent waiting here is reported as
    ``queue_wait_s`` and counted in ``ttft_s``.
    """

    def __init__(self, *, model: Any, processor: Any, settings: Settings, device: str,
                 dtype: torch.dtype, quantization: str, model_id: str, revision: str,
                 meaningful: bool, model_dir: Path) -> None:
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
                 on_first_token: Callable[[], None] | None = None) -> GenerationResult:
        """Greedy answer to ``prompt`` about the image in ``pixel_values`` ([1, 3, H, W]).

        ``on_first_token`` is called (on this thread) when the first new token exists.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        shape = tuple(pixel_values.shape)
        if len(shape) != 4 or shape[0] != 1 or shape[1] != 3 or shape[2:] != self.image_size:
            raise ValueError(f"pixel_values must be [1, 3, {self.image_size[0]}, "
                             f"{self.image_size[1]}], got {list(shape)}")
        entered = time.perf_counter()
        with self._lock:
            locked = time.perf_counter()
            ids, truncated = self.encode(prompt)
            cuda = self.device.startswith("cuda")
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            # Blocking copy: a non-blocking GPU-to-CPU copy could be read before it lands.
            pixels = pixel_values.to(device=self.device, dtype=self.dtype)
            clock = _streamer_class()(on_first_token)
            started = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                    pixel_values=pixels, max_new_tokens=max_new_tokens, do_sample=False,
                    num_beams=1, streamer=clock, pad_token_id=self.pad_token_id)
            new = out[0, input_ids.shape[1]:].tolist()
            finished = time.perf_counter()
            peak = int(torch.cuda.max_memory_allocated(self.device)) if cuda else None
        text = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        first = clock.first_token_at or finished
        return GenerationResult(
            text=text, input_tokens=len(ids), output_tokens=len(new),
            ttft_s=first - entered, prefill_s=first - started, generate_s=finished - first,
            peak_gpu_memory_bytes=peak, truncated=truncated, queue_wait_s=locked - entered)

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


def _attn_implementation(config: Any) -> str:
    names = {str(getattr(c, "_attn_implementation", None))
             for c in (config, getattr(config, "text_config", None),
                       getattr(config, "vision_config", None)) if c is not None}
    names.discard("None")
    if names == {"sdpa"}:
        return "sdpa"
    return ",".join(sorted(names)) or "unknown"


def _triple(value: Any, default: tuple[float, float, float]) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value), float(value), float(value))
    if isinstance(value, (list, tuple)) and len(value) == 3:
        return (float(value[0]), float(value[1]), float(value[2]))
    return default
