"""``mrc-agent loadgen``: a realistic open-loop mix of MRC requests, with per-bucket latency.

Every request falls in one of the nine prompt-length × resolution buckets the service labels its
metrics with, so the table printed at the end lines up with the dashboard heatmap. Photos are
synthetic JPEGs (gradients, noise, edges and printed text, so OCR has something to read) made
once per resolution; prompts are drawn from templates of the three lengths. About one request in
ten repeats an earlier (image, question) pair, which the service's context-aware cache may answer.

Requests go through the paths real clients take (``--api``, :data:`APIS`): ``upload`` is
``POST /mrc/upload`` (multipart), ``chat`` and ``chat-stream`` the OpenAI chat API
(``POST /v1/chat/completions``, the photo as a ``data:`` URL; streamed with
``stream_options.include_usage``, read event by event). The default, ``mix``, takes the three in
turn. A streamed answer's latency is to its ``[DONE]``; the time to its first content event is
its client-side TTFT, summarised after the table. The model's id comes from ``GET /v1/models``
(a service without it gets chat requests with no ``model``, which the reference service takes
as its own).

The generator is open-loop at ``--rate`` requests per second (a fixed schedule, so a slow server
sees the queue build up as real users would make it), with at most ``--max-in-flight`` requests
outstanding; requests that would exceed that are counted as "dropped by the client", not sent.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

#: (label, width, height): one photo size per resolution bucket, as received by the service.
RESOLUTIONS = [("<1MP", 800, 600), ("1-4MP", 2048, 1536), (">4MP", 4000, 3000)]
PROMPT_BUCKETS = ["0-50", "50-100", "100+"]
#: The request paths, as ``--api`` names them; ``mix`` takes them in turn.
APIS = ("upload", "chat", "chat-stream")
API_CHOICES = ("mix", *APIS)
CHAT_PATH = "/v1/chat/completions"
#: Realistic weights: most traffic is phone photos scaled by the app (1-4 MP) with short
#: questions; every bucket still gets at least 5 % so all nine cells fill.
RES_WEIGHTS = [0.35, 0.45, 0.20]
PROMPT_WEIGHTS = [0.55, 0.30, 0.15]

_SHORT = ["Is the parcel damaged?", "What is written on the label?", "Is the box open?",
          "How many items are visible?", "Is the seal intact?"]
_MEDIUM = ["The customer says this parcel arrived crushed. Which corner is damaged, and how?",
           "Read the shipping label and tell me the tracking number and the destination city.",
           "Is there water damage on this box, and does the label remain readable enough?"]
_LONG = [
    "A customer uploaded this photo of a parcel that was delivered yesterday afternoon. They "
    "claim the contents were broken in transit. Describe every visible sign of damage, read any "
    "handling labels, and say whether the damage looks like it happened before delivery.",
    "This is a photo of a package label taken in a warehouse under poor light. Please read the "
    "sender, the recipient, the tracking number and any barcode text, and list anything that "
    "could not be read so that a person can check it by hand before it is shipped.",
]


def prompt_bucket(chars: int) -> str:
    return "0-50" if chars < 50 else "50-100" if chars < 100 else "100+"


def make_prompt(bucket: str, rng: random.Random) -> str:
    pool = {"0-50": _SHORT, "50-100": _MEDIUM, "100+": _LONG}[bucket]
    text = rng.choice(pool)
    # A request number keeps prompts distinct (so the cache is not hit by accident) while the
    # length stays inside its bucket.
    tagged = f"{text} #{rng.randrange(1000)}"
    return tagged if prompt_bucket(len(tagged)) == bucket else text


def make_photo(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG: smooth gradients, sensor noise, box edges and a printed label."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = random.Random(seed)
    small = Image.linear_gradient("L").resize((width // 8, height // 8))
    flipped = small.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    base = Image.merge("RGB", (small, small.rotate(90), flipped))
    img = base.resize((width, height), Image.Resampling.BILINEAR)
    noise = Image.effect_noise((width // 4, height // 4), 24).resize((width, height))
    img = Image.blend(img, Image.merge("RGB", (noise, noise, noise)), 0.25)
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.randrange(width // 2), rng.randrange(height // 2)
        draw.rectangle([x0, y0, x0 + width // 3, y0 + height // 3], outline=(40, 30, 20),
                       width=max(width // 400, 2))
    lx, ly = width // 10, height // 10
    draw.rectangle([lx, ly, lx + width // 2, ly + height // 5], fill=(250, 250, 245))
    try:
        from PIL import ImageFont

        font = ImageFont.load_default(size=max(height // 25, 12))
    except (TypeError, OSError):
        font = None
    draw.text((lx + 20, ly + 20), "FRAGILE  TRACK 4711 0815 DE", fill=(10, 10, 10), font=font)
    img = img.filter(ImageFilter.GaussianBlur(0.6))
    out = io.BytesIO()
    img.save(out, "JPEG", quality=88)
    return out.getvalue()


@dataclass
class Outcome:
    latencies: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    cached: int = 0
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dropped: int = 0
    sent: int = 0
    #: Requests sent per API.
    by_api: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Client-side time to the first content event of each streamed answer, seconds.
    ttfts: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


def table(outcome: Outcome) -> str:
    lines = ["resolution  prompt    count    p50 ms    p90 ms    p99 ms",
             "----------  ------  -------  --------  --------  --------"]
    for res, _, _ in RESOLUTIONS:
        for pb in PROMPT_BUCKETS:
            vals = outcome.latencies.get((res, pb), [])
            if vals:
                p = [percentile(vals, q) * 1000 for q in (50, 90, 99)]
                lines.append(f"{res:<10}  {pb:<6}  {len(vals):>7}  {p[0]:>8.0f}  {p[1]:>8.0f}  "
                             f"{p[2]:>8.0f}")
            else:
                lines.append(f"{res:<10}  {pb:<6}  {0:>7}  {'-':>8}  {'-':>8}  {'-':>8}")
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.statuses.items()))
    lines.append(f"\nsent {outcome.sent}, statuses {{{statuses}}}, cached answers "
                 f"{outcome.cached}, client-side drops {outcome.dropped}")
    if outcome.by_api:
        line = "by API: " + ", ".join(f"{k} {v}" for k, v in sorted(outcome.by_api.items()))
        if outcome.ttfts:
            line += (f"; streamed time to first content p50 "
                     f"{percentile(outcome.ttfts, 50) * 1000:.0f} ms, p90 "
                     f"{percentile(outcome.ttfts, 90) * 1000:.0f} ms")
        lines.append(line)
    if outcome.errors:
        lines.append("errors: " + ", ".join(f"{k}: {v}" for k, v in outcome.errors.items()))
    return "\n".join(lines)


def chat_body(prompt: str, data_url: str, max_tokens: int, model: str | None,
              stream: bool) -> dict[str, Any]:
    """An OpenAI chat request: the question and the photo in one user message."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": prompt},
            {"type": "image_url", "image_url": {"url": data_url}}]}],
        "max_tokens": max_tokens, "stream": stream}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def read_stream(lines: Any, t0: float) -> tuple[float | None, bool, str | None]:
    """Read a chat stream's server-sent events: (seconds from ``t0``, a ``perf_counter``
    reading, to the first content event; whether ``[DONE]`` ended it; the code of an error
    event)."""
    first: float | None = None
    async for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return first, True, None
        event = json.loads(payload)
        if "error" in event:
            return first, False, str(event["error"].get("code"))
        choices = event.get("choices") or []
        if first is None and choices and choices[0].get("delta", {}).get("content"):
            first = time.perf_counter() - t0
    return first, False, None


async def served_model(client: Any, url: str) -> str | None:
    """The id ``GET /v1/models`` lists first, or None where there is none."""
    import httpx

    try:
        r = await client.get(url.rstrip("/") + "/v1/models")
        data = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return str(data[0]["id"]) if isinstance(data, list) and data else None


async def run_load(url: str, rate: float, duration: float, max_new_tokens: int = 16,
                   max_in_flight: int = 64, seed: int = 1, timeout: float = 120.0,
                   on_progress: Callable[[Outcome], None] | None = None,
                   api: str = "mix") -> Outcome:
    import httpx

    if api not in API_CHOICES:
        raise ValueError(f"api must be one of {', '.join(API_CHOICES)}, got {api!r}")
    rng = random.Random(seed)
    photos = {label: make_photo(w, h, seed + i) for i, (label, w, h) in enumerate(RESOLUTIONS)}
    data_urls = {label: "data:image/jpeg;base64," + base64.b64encode(photo).decode()
                 for label, photo in photos.items()}
    outcome = Outcome()
    history: list[tuple[str, str]] = []
    in_flight: set[asyncio.Task[None]] = set()
    endpoint = url.rstrip("/") + "/mrc/upload"
    chat = url.rstrip("/") + CHAT_PATH
    model: str | None = None

    def answered(res: str, prompt: str, t0: float, cached: bool) -> None:
        outcome.latencies[(res, prompt_bucket(len(prompt)))].append(time.perf_counter() - t0)
        outcome.cached += cached

    async def upload(client: httpx.AsyncClient, res: str, prompt: str, t0: float) -> None:
        r = await client.post(endpoint, files={"file": ("photo.jpg", photos[res],
                                                        "image/jpeg")},
                              data={"text_prompt": prompt,
                                    "max_new_tokens": str(max_new_tokens)})
        outcome.statuses[r.status_code] += 1
        if r.status_code == 200:
            answered(res, prompt, t0, bool(r.json().get("cached")))

    async def whole(client: httpx.AsyncClient, res: str, prompt: str, t0: float) -> None:
        r = await client.post(chat, json=chat_body(prompt, data_urls[res], max_new_tokens,
                                                   model, False))
        outcome.statuses[r.status_code] += 1
        if r.status_code == 200:
            answered(res, prompt, t0, r.headers.get("x-mrc-cached") == "true")

    async def streamed(client: httpx.AsyncClient, res: str, prompt: str, t0: float) -> None:
        body = chat_body(prompt, data_urls[res], max_new_tokens, model, True)
        async with client.stream("POST", chat, json=body) as r:
            outcome.statuses[r.status_code] += 1
            if r.status_code != 200:
                await r.aread()
                return
            first, done, error = await read_stream(r.aiter_lines(), t0)
        if error is not None:
            outcome.errors[f"stream error {error}"] += 1
        elif not done:
            outcome.errors["stream ended without [DONE]"] += 1
        else:
            if first is not None:
                outcome.ttfts.append(first)
            answered(res, prompt, t0, r.headers.get("x-mrc-cached") == "true")

    senders = {"upload": upload, "chat": whole, "chat-stream": streamed}

    async def one(client: httpx.AsyncClient, kind: str, res: str, prompt: str) -> None:
        try:
            await senders[kind](client, res, prompt, time.perf_counter())
        except httpx.HTTPError as exc:
            outcome.errors[type(exc).__name__] += 1

    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if api != "upload":
            model = await served_model(client, url)
        start = time.monotonic()
        n = 0
        next_progress = start + 1.0
        while (now := time.monotonic()) - start < duration:
            due = start + n / rate
            if now < due:
                await asyncio.sleep(min(due - now, 0.2))
                if on_progress and time.monotonic() >= next_progress:
                    on_progress(outcome)
                    next_progress += 1.0
                continue
            n += 1
            if len(in_flight) >= max_in_flight:
                outcome.dropped += 1
                continue
            if history and rng.random() < 0.1:
                res, prompt = rng.choice(history)
            else:
                res = rng.choices([r for r, _, _ in RESOLUTIONS], RES_WEIGHTS)[0]
                prompt = make_prompt(rng.choices(PROMPT_BUCKETS, PROMPT_WEIGHTS)[0], rng)
                history.append((res, prompt))
            kind = APIS[outcome.sent % len(APIS)] if api == "mix" else api
            outcome.sent += 1
            outcome.by_api[kind] += 1
            task = asyncio.create_task(one(client, kind, res, prompt))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.wait(in_flight, timeout=timeout)
    return outcome


def run_loadgen(url: str, rate: float, duration: float, max_new_tokens: int,
                max_in_flight: int, seed: int, out: TextIO = sys.stdout, *,
                api: str = "mix") -> int:
    outcome = asyncio.run(run_load(url, rate, duration, max_new_tokens, max_in_flight, seed,
                                   api=api))
    out.write(table(outcome) + "\n")
    return 0 if outcome.sent and not outcome.errors else 1
