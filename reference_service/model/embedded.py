"""The embedded model: a tiny random-weight Llava built here, so the service runs offline.

With no ``--model`` the service runs a ``LlavaForConditionalGeneration`` (CLIP vision tower + Llama
text model) with a byte-level BPE tokenizer trained in process with ``tokenizers``
(:func:`build_tokenizer`). Random weights from a fixed seed: its answers are NOT meaningful.
:func:`ensure_embedded` builds it on first run into ``cache_dir/embedded-llava-tiny`` (in a
temporary sibling directory, renamed into place once complete, so a crash never leaves half a model;
partial builds of dead processes are removed) and returns the directory afterwards. Loading it is
:mod:`~mrc_agent.reference_service.model.loading`'s job, like any local checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mrc_agent.reference_service.model.common import (
    _CLIP_MEAN,
    _CLIP_STD,
    ModelLoadError,
    Progress,
    _quiet_transformers,
)

#: One logger for the whole model layer, named as it was before the package split.
logger = logging.getLogger(__name__)

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
