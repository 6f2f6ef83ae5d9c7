"""The VLM layer: embedded model build and cache, generation, truncation, NF4, attention detection.

Real parts throughout: the embedded model is really built (once per session, in a temporary
cache directory) and really generates on the CPU. Nothing may touch the network: the hub is
switched offline and socket connects fail loudly while models are built and loaded.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere below

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mrc_agent.reference_service import model as vlm_mod  # noqa: E402
from mrc_agent.reference_service.model import (  # noqa: E402  # noqa: E402
    EMBEDDED_DIRNAME,
    EMBEDDED_MARKER,
    VLM,
    AttentionReport,
    GenerationResult,
    ModelLoadError,
    attention,
    attention_warning,
    backend_counts_from_ops,
    choose_backend,
    detect_attention_backend,
    embedded,
    ensure_embedded,
    load_vlm,
    loading,
    probe_sdpa_backend,
)
from mrc_agent.reference_service.settings import Settings  # noqa: E402

KNOWN_BACKENDS = {"flash", "efficient", "cudnn", "math", "eager"}


class NetworkUsed(AssertionError):
    pass


@pytest.fixture(scope="module")
def no_network() -> Iterator[None]:
    """Any attempt to open a network connection fails the test that made it."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NetworkUsed(f"network access attempted: {args!r}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket.socket, "connect_ex", refuse)
        mp.setattr(socket, "create_connection", refuse)
        yield


@dataclass
class Built:
    cache_dir: Path
    messages: list[str]
    vlm: VLM


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, no_network: None) -> Iterator[Built]:
    """The embedded model, built once for the whole session into a fresh cache directory.

    Runs with the model's CPU thread hint applied (see docs/model.md), restored afterwards:
    on a shared CI machine two intra-op threads make each tiny matmul wait for a busy core.
    """
    cache_dir = tmp_path_factory.mktemp("mrc-cache")
    messages: list[str] = []
    threads = torch.get_num_threads()
    vlm = load_vlm(Settings(cache_dir=cache_dir), progress=messages.append)
    if vlm.cpu_threads_hint:
        torch.set_num_threads(vlm.cpu_threads_hint)
    try:
        yield Built(cache_dir, messages, vlm)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def nf4(built: Built) -> VLM:
    return load_vlm(Settings(cache_dir=built.cache_dir, quantize="nf4"))


def settings_for(built: Built, **kw: Any) -> Settings:
    return Settings(cache_dir=built.cache_dir, **kw)


# --- build and cache ----------------------------------------------------------------------------

def test_first_load_builds_and_second_load_reuses_the_cache(built: Built) -> None:
    assert any("building the embedded model" in m for m in built.messages)
    assert any("training tokenizer" in m for m in built.messages)
    target = built.cache_dir / EMBEDDED_DIRNAME
    marker = json.loads((target / EMBEDDED_MARKER).read_text())
    assert marker["meaningful"] is False
    config = json.loads((target / "config.json").read_text())
    assert config["mrc_random_weights"] is True
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    weights_mtime = (target / "model.safetensors").stat().st_mtime_ns

    again: list[str] = []
    vlm = load_vlm(settings_for(built), progress=again.append)
    assert not any("build" in m or "training" in m for m in again), again
    assert any("loading embedded model" in m for m in again)
    assert (target / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert vlm.info.revision == built.vlm.info.revision
    # Nothing half-built is left beside it.
    assert [p.name for p in built.cache_dir.iterdir()] == [EMBEDDED_DIRNAME]


def test_embedded_model_says_its_answers_are_not_meaningful(built: Built) -> None:
    vlm = built.vlm
    assert vlm.meaningful is False
    assert vlm.info.model_id == "mrc-embedded/llava-tiny-random"
    assert vlm.info.device == "cpu" and vlm.device == "cpu"
    assert vlm.info.dtype == "float32"
    assert vlm.info.quantization == "none"
    assert vlm.image_size == (224, 224)
    assert len(vlm.image_mean) == 3 and len(vlm.image_std) == 3
    assert type(vlm.model).__name__ == "LlavaForConditionalGeneration"
    assert vlm.cpu_threads_hint == 1  # tiny matrices: one intra-op thread (see docs/model.md)


def test_crash_mid_build_leaves_no_half_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              no_network: None) -> None:
    import transformers

    def boom(self: Any, *a: Any, **k: Any) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(transformers.LlavaForConditionalGeneration, "save_pretrained", boom)
    with pytest.raises(ModelLoadError, match="disk full"):
        ensure_embedded(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_stale_partial_builds_of_dead_processes_are_removed(tmp_path: Path) -> None:
    target = tmp_path / EMBEDDED_DIRNAME
    dead = tmp_path / f".{EMBEDDED_DIRNAME}.build-999999999-abc"
    mine = tmp_path / f".{EMBEDDED_DIRNAME}.build-{os.getpid()}-xyz"
    dead.mkdir()
    mine.mkdir()
    embedded._remove_stale_builds(target)
    assert not dead.exists()
    assert mine.exists()  # possibly a build in progress in another thread of this process


def test_a_directory_without_the_marker_is_not_a_finished_build(tmp_path: Path) -> None:
    target = tmp_path / EMBEDDED_DIRNAME
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert not embedded._embedded_ready(target)
    (target / EMBEDDED_MARKER).write_text(json.dumps({"format": vlm_mod.EMBEDDED_FORMAT}))
    assert embedded._embedded_ready(target)


# --- generation ---------------------------------------------------------------------------------

def test_generate_returns_text_token_counts_and_timings(built: Built) -> None:
    vlm = built.vlm
    r = vlm.generate(vlm.blank_pixels(), "What is damaged on this parcel?", max_new_tokens=16)
    assert isinstance(r, GenerationResult)
    assert isinstance(r.text, str) and r.text
    assert "\ufffd" not in r.text
    # The embedded model never stops early (EOS suppressed): predictable load.
    assert r.output_tokens == 16
    assert r.input_tokens == len(vlm.encode("What is damaged on this parcel?")[0])
    assert r.peak_gpu_memory_bytes is None  # CPU
    assert r.peak_gpu_memory_shared_with is None
    assert r.truncated is False
    assert 0 < r.prefill_s <= r.ttft_s
    assert r.generate_s >= 0
    # Greedy: the same question gets the same answer.
    again = vlm.generate(vlm.blank_pixels(), "What is damaged on this parcel?", max_new_tokens=16)
    assert again.text == r.text


def test_pixel_values_may_arrive_in_another_dtype(built: Built) -> None:
    vlm = built.vlm
    r = vlm.generate(vlm.blank_pixels().to(torch.float64), "colour?", max_new_tokens=2)
    assert r.output_tokens >= 1


def test_generate_rejects_wrong_shapes_and_token_counts(built: Built) -> None:
    vlm = built.vlm
    with pytest.raises(ValueError, match="pixel_values"):
        vlm.generate(torch.zeros(1, 3, 100, 100), "hi", 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        vlm.generate(vlm.blank_pixels(), "hi", 0)


def test_short_prompt_is_never_padded(built: Built) -> None:
    vlm = built.vlm
    r = vlm.generate(vlm.blank_pixels(), "Is the box wet?", max_new_tokens=2)
    # Image placeholders plus a handful of template and prompt tokens: nowhere near 512/2048.
    assert vlm.num_image_tokens == 196
    assert vlm.num_image_tokens < r.input_tokens < vlm.num_image_tokens + 30
    ids, truncated = vlm.encode("Is the box wet?")
    assert not truncated
    assert vlm.tokenizer.pad_token_id not in ids


def test_long_prompt_is_truncated_within_the_limit_keeping_the_template(built: Built) -> None:
    vlm = built.vlm
    prompt = ("Please describe every dent, tear and label on this parcel. " * 200)[:10_000]
    assert len(prompt) == 10_000
    r = vlm.generate(vlm.blank_pixels(), prompt, max_new_tokens=4)
    assert r.truncated is True
    assert r.input_tokens <= Settings().max_input_tokens
    assert r.input_tokens >= Settings().max_input_tokens - 8  # used the budget, not thrown away
    ids, _ = vlm.encode(prompt)
    text = vlm.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.rstrip().endswith("ASSISTANT:")  # the cut is in the user's text
    assert ids.count(vlm.image_token_id) == vlm.num_image_tokens


def test_truncation_respects_a_smaller_limit_and_whole_characters(built: Built) -> None:
    vlm = load_vlm(settings_for(built, max_input_tokens=260))
    assert vlm.max_input_tokens == 260
    prompt = "包裹的角被压坏了吗？😀 " * 400
    ids, truncated = vlm.encode(prompt)
    assert truncated and len(ids) <= 260
    assert "\ufffd" not in vlm.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_limit_too_small_for_the_image_is_a_load_error(built: Built) -> None:
    with pytest.raises(ModelLoadError, match="max_input_tokens"):
        load_vlm(settings_for(built, max_input_tokens=150))


def test_the_image_placeholder_in_user_text_cannot_break_the_image(built: Built) -> None:
    vlm = built.vlm
    ids, _ = vlm.encode("look <image> here <image>")
    assert ids.count(vlm.image_token_id) == vlm.num_image_tokens
    r = vlm.generate(vlm.blank_pixels(), "look <image> here", max_new_tokens=2)
    assert r.output_tokens >= 1


def test_concurrent_callers_are_serialised_and_get_the_same_answer(built: Built) -> None:
    vlm = built.vlm
    expected = vlm.generate(vlm.blank_pixels(), "How many boxes?", max_new_tokens=8).text
    results: list[str] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            results.append(vlm.generate(vlm.blank_pixels(), "How many boxes?", 8).text)
        except BaseException as exc:  # collected, then asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [expected] * 4


def test_warmup(built: Built) -> None:
    built.vlm.warmup()
    assert built.vlm.warmed


# --- NF4 ----------------------------------------------------------------------------------------

def test_nf4_quantized_model_generates(nf4: VLM) -> None:
    import bitsandbytes as bnb

    assert nf4.info.quantization == "nf4"
    assert nf4.info.dtype == "float32"  # compute dtype on CPU
    quantized = [n for n, m in nf4.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert any("language_model" in n for n in quantized)
    # Vision tower, projector and lm_head stay in full precision.
    assert not [n for n in quantized
                if "vision_tower" in n or "multi_modal_projector" in n or "lm_head" in n]
    assert nf4.model.config.quantization_config.bnb_4bit_use_double_quant
    layer: Any = next(m for m in nf4.model.modules() if isinstance(m, bnb.nn.Linear4bit))
    state = layer.weight.quant_state
    assert state.quant_type == "nf4"
    # Double quantisation: on CPUs with AVX512-BF16, bitsandbytes repacks the weight for its CPU
    # kernel at the first forward and keeps the block scales in fp32 from then on, remembering
    # that they were double-quantised in ``original_nested``.
    assert getattr(state, "original_nested", state.nested)
    r = nf4.generate(nf4.blank_pixels(), "What is damaged on this parcel?", max_new_tokens=16)
    assert r.output_tokens >= 1 and isinstance(r.text, str)


def test_unknown_quantization_is_a_load_error(built: Built) -> None:
    with pytest.raises(ModelLoadError, match="quantization"):
        load_vlm(settings_for(built, quantize="int3"))


# --- attention backend --------------------------------------------------------------------------

def test_attention_backend_on_cpu_is_observed(built: Built) -> None:
    vlm = built.vlm
    report = vlm.attention
    assert report is not None and report.method == "profiler"
    assert report.attn_implementation == "sdpa"
    assert vlm.attention_backend == vlm.info.attention_backend == report.backend
    # CPU: PyTorch's CPU flash kernel or the math kernel, nothing CUDA-only.
    assert report.backend in {"flash", "math"}
    # Two generation steps x (2 vision + 2 text layers): every SDPA call accounted for.
    assert sum(report.counts.values()) == 6
    assert "unknown" not in report.counts
    assert attention_warning("cpu", report) is None


def test_detection_sees_a_forced_math_kernel(built: Built) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    vlm = built.vlm
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            report = vlm.detect_attention()
        assert report.backend == "math"
        assert report.counts == {"math": 6}
        assert vlm.info.attention_backend == "math"
    finally:
        vlm.detect_attention()
    assert vlm.info.attention_backend in {"flash", "math"}


def test_detection_reports_eager_when_the_model_does_not_use_sdpa(built: Built) -> None:
    from transformers import LlavaForConditionalGeneration

    path = built.cache_dir / EMBEDDED_DIRNAME
    model = LlavaForConditionalGeneration.from_pretrained(
        path, local_files_only=True, attn_implementation="eager").eval()
    ids = torch.tensor([built.vlm.encode("hi")[0]])
    pixels = built.vlm.blank_pixels()

    def forward() -> object:
        with torch.inference_mode():
            return model(input_ids=ids, pixel_values=pixels)

    report = detect_attention_backend(forward, attention._attn_implementation(model.config))
    assert report.backend == "eager"
    assert report.attn_implementation == "eager"


def test_backend_counting_from_profiler_op_names() -> None:
    ops = (["aten::scaled_dot_product_attention",
            "aten::_scaled_dot_product_flash_attention"] * 3
           + ["aten::scaled_dot_product_attention",
              "aten::_scaled_dot_product_attention_math"] * 5
           + ["aten::scaled_dot_product_attention", "aten::matmul"])
    counts, calls = backend_counts_from_ops(ops)
    assert calls == 9
    assert counts == {"flash": 3, "math": 5, "unknown": 1}
    assert choose_backend(counts) == "math"
    assert choose_backend({"flash": 2, "efficient": 2}) == "efficient"  # tie: the slower one
    assert choose_backend({"flash": 30, "math": 2}) == "flash"
    assert choose_backend({}) == "eager"
    assert backend_counts_from_ops(["aten::_scaled_dot_product_flash_attention_for_cpu",
                                    "aten::scaled_dot_product_attention"]) == ({"flash": 1}, 1)


def test_cuda_fallback_to_math_is_warned_and_cpu_is_not() -> None:
    math = AttentionReport(backend="flash", counts={"flash": 40, "math": 24},
                           attn_implementation="sdpa",
                           reasons=["flash: head_dim 160 not supported"])
    message = attention_warning("cuda:0", math)
    assert message is not None and "math" in message and "head_dim 160" in message
    assert attention_warning("cpu", math) is None
    fine = AttentionReport(backend="flash", counts={"flash": 9})
    assert attention_warning("cuda:0", fine) is None


def test_probe_follows_the_priority_order_and_says_why(built: Built) -> None:
    backend, reasons = probe_sdpa_backend(4, 32, torch.float32, "cpu")
    assert backend in KNOWN_BACKENDS
    # On CPU the CUDA-only memory-efficient kernel is refused, the math kernel always runs.
    backend, reasons = probe_sdpa_backend(4, 32, torch.float32, "cpu", order=["efficient", "math"])
    assert backend == "math"
    assert len(reasons) == 1 and reasons[0].startswith("efficient:")
    assert vlm_mod.sdpa_priority_order()[0] == "flash"


def test_probe_answers_when_the_profiler_is_busy(built: Built) -> None:
    def run() -> object:
        raise AssertionError("not reached")

    import torch.profiler

    class Busy:
        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def __enter__(self) -> Busy:
            raise RuntimeError("profiler already enabled on this thread")

        def __exit__(self, *a: Any) -> None:
            return None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.profiler, "profile", Busy)
        report = detect_attention_backend(run, "sdpa", probe=lambda: ("math", ["flash: no"]))
    assert report.method == "probe" and report.backend == "math"


# --- --model PATH -------------------------------------------------------------------------------

def test_missing_model_path_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_vlm(Settings(model=str(tmp_path / "nope"), cache_dir=tmp_path))


def test_a_file_or_a_directory_without_config_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_vlm(Settings(model=str(tmp_path / "weights.bin"), cache_dir=tmp_path))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_vlm(Settings(model=str(tmp_path), cache_dir=tmp_path))


def test_a_text_only_checkpoint_is_unsupported(tmp_path: Path, no_network: None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2)).save_pretrained(
        tmp_path / "llama")
    with pytest.raises(ModelLoadError, match="processor|unsupported"):
        load_vlm(Settings(model=str(tmp_path / "llama"), cache_dir=tmp_path))


def test_the_saved_embedded_dir_loads_through_the_auto_path(built: Built) -> None:
    path = built.cache_dir / EMBEDDED_DIRNAME
    messages: list[str] = []
    vlm = load_vlm(Settings(model=str(path), cache_dir=built.cache_dir / "unused"),
                   progress=messages.append)
    assert not any("build" in m for m in messages)
    assert not (built.cache_dir / "unused").exists()
    assert vlm.meaningful is False  # the marker travels with the directory
    assert vlm.info.revision == built.vlm.info.revision
    r = vlm.generate(vlm.blank_pixels(), "What is damaged on this parcel?", max_new_tokens=16)
    expected = built.vlm.generate(built.vlm.blank_pixels(), "What is damaged on this parcel?", 16)
    assert r.text == expected.text


def test_unknown_device_and_dtype_are_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="device"):
        vlm_mod.resolve_device("tpu")
    with pytest.raises(ModelLoadError, match="dtype"):
        vlm_mod.resolve_dtype("float8", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            vlm_mod.resolve_device("cuda")
        assert vlm_mod.resolve_device("auto") == "cpu"
    assert vlm_mod.resolve_dtype("auto", "cpu") == torch.float32
    assert vlm_mod.resolve_dtype("auto", "cuda:0") == torch.float16


def test_a_pre_quantised_checkpoint_reports_its_quantisation() -> None:
    class Config:
        def __init__(self, qc: dict[str, Any] | None) -> None:
            if qc is not None:
                self.quantization_config = qc

    class Model:
        def __init__(self, qc: dict[str, Any] | None) -> None:
            self.config = Config(qc)

    assert loading._quantization_of(Model(None), "none") == "none"
    assert loading._quantization_of(Model(None), "nf4") == "nf4"
    bnb4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    assert loading._quantization_of(Model(bnb4), "none") == "nf4"
    assert loading._quantization_of(Model({"quant_method": "awq"}), "none") == "awq"


def test_loads_and_detects_attention_on_a_worker_thread(built: Built) -> None:
    """The service loads the model with asyncio.to_thread; the profiler must work there too."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        vlm = pool.submit(load_vlm, settings_for(built)).result()
    assert vlm.attention is not None and vlm.attention.method == "profiler"
    assert vlm.attention_backend == built.vlm.attention_backend
    assert sum(vlm.attention.counts.values()) == 6
