"""Histogram bucket boundaries and label-bucket edges for the MRC request metrics, in one place.

Every boundary a dashboard, an alert or an SLO query depends on lives here, with the reason it is
what it is (the habit of vLLM's ``buckets.py``). Changing a boundary changes the series a
``histogram_quantile`` reads, so change it here on purpose and nowhere else.

Histogram buckets (upper bounds, seconds or bytes; ``+Inf`` is added by prometheus-client):

* ``REQUEST_DURATION_BUCKETS`` — a vision-language request spans from tens of milliseconds (a
  cache hit, a tiny model on a GPU) to about a minute (a 12 MP photo decoded and OCR'd on CPU, then
  a few hundred tokens generated). The steps are roughly 1-1.5-2-3-5 per decade, so each bucket is
  at most ~1.5x its neighbour and ``histogram_quantile`` interpolates within ~25 %; 0.5 s is a
  boundary so the request SLA can be read exactly as well.
* ``TIME_TO_FIRST_TOKEN_BUCKETS`` — the service's SLA is a first token within 500 ms, so
  ``le="0.5"`` MUST exist (an SLA ratio is ``bucket{le="0.5"} / count``, exact only on a
  boundary). Buckets are dense around it (0.3, 0.4, 0.5, 0.6, 0.75) to show how close to the line
  the distribution sits, sparse above 2 s where only "how bad" matters.
* ``TIME_PER_OUTPUT_TOKEN_BUCKETS`` — decode steps of a VLM take ~5-50 ms per token on a GPU and
  ~50-500 ms on CPU; the buckets cover 5 ms to 2.5 s, densest on the GPU range.
* ``STAGE_DURATION_BUCKETS`` — one histogram for every stage of the chain, so it must span a
  sub-millisecond postprocess and a multi-second fetch or OCR of a huge photo: 1-2.5-5 steps from
  1 ms to 60 s (the fetch timeout's order of magnitude).
* ``QUEUE_TIME_BUCKETS`` — time a request the service took on waited for a processing slot:
  0 (a free slot: the first bucket) up to the request timeout's order of magnitude; 1 ms to
  60 s in 1-2.5-5 steps, the stage buckets' grid so queueing and a stage compare bucket by
  bucket.
* ``PEAK_GPU_MEMORY_BUCKETS`` — peak device memory allocated while serving one request (weights
  included, as ``torch.cuda.max_memory_allocated`` reports after a reset). Powers of two from
  64 MiB to 16 GiB (small and quantised models), then the sizes of real cards (24, 32, 40, 48, 64,
  80, 96, 128, 144, 192 GiB) so "how close to this card's memory" is readable on L4/A10 through
  H100/H200/B200.

* ``REQUEST_IMAGES_BUCKETS`` — images per request: 0 (text only), 1 (the usual MRC request), then
  doubling to 16; OpenAI-compatible servers cap images per prompt in single digits by default.

Label buckets (the ``prompt_length`` and ``resolution`` labels):

* ``PROMPT_LENGTH_EDGES = (50, 100)`` characters of the text prompt (Unicode code points, i.e.
  ``len(str)``): short question / one sentence / long instruction. Values ``0-50``, ``50-100``,
  ``100+``.
* ``RESOLUTION_EDGES_MP = (1.0, 4.0)`` megapixels of the image *as received* (before any resize),
  decimal megapixels (``width * height / 1e6``): below 1 MP is a thumbnail or screenshot, 1-4 MP a
  resized photo, above 4 MP a phone camera original (12 MP) whose decode and resize dominate CPU.
  Values ``<1MP``, ``1-4MP``, ``>4MP``.

A meter that cannot see an image's size (a remote ``image_url`` it never fetches) puts the
request in the ``unknown`` resolution cell (``RESOLUTION_UNKNOWN``), which
``MRCMetrics(resolution_unknown=True)`` creates; a request with no image at all has 0 pixels, so
``<1MP``.

Boundary rule, for both label buckets: intervals are half-open ``[lo, hi)`` — a value equal to an
edge belongs to the bucket *above* it. So 49 characters is ``0-50``, 50 characters is ``50-100``,
100 characters is ``100+``; 999x1000 (0.999 MP) is ``<1MP``, 1000x1000 (exactly 1 MP) is
``1-4MP``, and 2000x2000 (exactly 4 MP) is ``>4MP`` — read ``>4MP`` as "4 MP or more". Resolution
is compared in whole pixels (``width * height >= round(edge * 1e6)``), so no float rounding decides
a boundary.

Label values are generated from the edges (``prompt_length_values``, ``resolution_values``), so
custom edges give names in the same pattern: edges ``(20, 200, 1000)`` give ``0-20``, ``20-200``,
``200-1000``, ``1000+``; edges ``(0.5, 2, 8)`` MP give ``<0.5MP``, ``0.5-2MP``, ``2-8MP``,
``>8MP``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import pairwise

#: The time-to-first-token SLA; ``TIME_TO_FIRST_TOKEN_BUCKETS`` must contain it.
TTFT_SLA_SECONDS = 0.5

REQUEST_DURATION_BUCKETS: tuple[float, ...] = (
    0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 45.0, 60.0,
)

TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 10.0, 20.0, 30.0, 60.0,
)

TIME_PER_OUTPUT_TOKEN_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5,
)

STAGE_DURATION_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

QUEUE_TIME_BUCKETS: tuple[float, ...] = STAGE_DURATION_BUCKETS

_MiB = 1 << 20
_GiB = 1 << 30
PEAK_GPU_MEMORY_BUCKETS: tuple[float, ...] = tuple(
    float(b) for b in (
        *(_MiB << k for k in range(6, 15)),  # 64 MiB .. 16 GiB, doubling
        *(g * _GiB for g in (24, 32, 40, 48, 64, 80, 96, 128, 144, 192)),
    )
)

REQUEST_IMAGES_BUCKETS: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0)

PROMPT_LENGTH_EDGES: tuple[int, ...] = (50, 100)
#: The ``resolution`` value of a request whose image size nobody measured.
RESOLUTION_UNKNOWN = "unknown"
RESOLUTION_EDGES_MP: tuple[float, ...] = (1.0, 4.0)

assert TTFT_SLA_SECONDS in TIME_TO_FIRST_TOKEN_BUCKETS, "the 500 ms SLA must be a bucket boundary"


def _check_edges(edges: Sequence[float], what: str) -> None:
    if not edges:
        raise ValueError(f"{what} edges must not be empty")
    if any(e <= 0 for e in edges):
        raise ValueError(f"{what} edges must be positive, got {tuple(edges)}")
    if any(b <= a for a, b in pairwise(edges)):
        raise ValueError(f"{what} edges must be strictly increasing, got {tuple(edges)}")


def _fmt(x: float) -> str:
    """``1.0`` -> ``1``, ``0.5`` -> ``0.5``: the shortest faithful spelling of an edge."""
    return f"{x:g}"


def prompt_length_values(edges: Sequence[int] = PROMPT_LENGTH_EDGES) -> tuple[str, ...]:
    """All ``prompt_length`` label values for ``edges``, smallest first (``0-50`` .. ``100+``)."""
    _check_edges(edges, "prompt length")
    if any(int(e) != e for e in edges):
        raise ValueError(f"prompt length edges must be whole characters, got {tuple(edges)}")
    bounds = [0, *(int(e) for e in edges)]
    return (*(f"{lo}-{hi}" for lo, hi in pairwise(bounds)), f"{bounds[-1]}+")


def resolution_values(edges: Sequence[float] = RESOLUTION_EDGES_MP) -> tuple[str, ...]:
    """All ``resolution`` label values for ``edges`` (megapixels), smallest first."""
    _check_edges(edges, "resolution")
    inner = (f"{_fmt(lo)}-{_fmt(hi)}MP" for lo, hi in pairwise(edges))
    return (f"<{_fmt(edges[0])}MP", *inner, f">{_fmt(edges[-1])}MP")


def prompt_length_bucket(chars: int, edges: Sequence[int] = PROMPT_LENGTH_EDGES) -> str:
    """The ``prompt_length`` label for a prompt of ``chars`` characters; ``[lo, hi)`` intervals.

    >>> prompt_length_bucket(49), prompt_length_bucket(50), prompt_length_bucket(100)
    ('0-50', '50-100', '100+')
    """
    if chars < 0:
        raise ValueError(f"prompt length must be >= 0, got {chars}")
    # bisect_right puts a value equal to an edge in the bucket above it: [lo, hi).
    return prompt_length_values(edges)[bisect_right(edges, chars)]


def resolution_bucket(width: int, height: int,
                      edges: Sequence[float] = RESOLUTION_EDGES_MP) -> str:
    """The ``resolution`` label for a ``width`` x ``height`` image; ``[lo, hi)`` in megapixels.

    >>> resolution_bucket(999, 1000), resolution_bucket(1000, 1000), resolution_bucket(2000, 2000)
    ('<1MP', '1-4MP', '>4MP')
    """
    if width < 0 or height < 0:
        raise ValueError(f"image size must be >= 0, got {width}x{height}")
    return resolution_values(edges)[bisect_right(pixel_edges(edges), width * height)]


def pixel_edges(edges_mp: Sequence[float] = RESOLUTION_EDGES_MP) -> tuple[int, ...]:
    """Megapixel edges as whole pixel counts, so boundaries are decided without float error."""
    return tuple(round(e * 1_000_000) for e in edges_mp)
