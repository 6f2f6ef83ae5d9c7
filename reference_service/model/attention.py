"""Which scaled-dot-product-attention (SDPA) kernel the model really runs on this device.

:func:`detect_attention_backend` watches one short generation with the PyTorch profiler and
counts the kernels ``torch.nn.functional.scaled_dot_product_attention`` dispatched to; when the
profiler is unavailable, :func:`probe_sdpa_backend` tries each backend alone on model-shaped
inputs. :func:`attention_warning` says when CUDA falls back to the slow math kernel. The pure
parts (:func:`backend_counts_from_ops`, :func:`choose_backend`) are tested directly.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: One logger for the whole model layer, named as it was before the package split.
logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("flash", "efficient", "cudnn", "math", "overrideable", "eager", "unknown")

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


def _attn_implementation(config: Any) -> str:
    names = {str(getattr(c, "_attn_implementation", None))
             for c in (config, getattr(config, "text_config", None),
                       getattr(config, "vision_config", None)) if c is not None}
    names.discard("None")
    if names == {"sdpa"}:
        return "sdpa"
    return ",".join(sorted(names)) or "unknown"
