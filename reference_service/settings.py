"""The reference service's settings: one typed object with every limit in one place.

Each limit says why it is what it is. Settings come from ``python -m mrc_agent.reference_service``
flags (and ``MRC_SERVICE_*`` environment variables); tests build them directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def default_cache_dir() -> Path:
    """Where the embedded model is built once and reused (``$MRC_CACHE_DIR`` or XDG cache)."""
    base = os.environ.get("MRC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mrc-agent")
    return Path(base)


@dataclass
class Settings:
    # --- model ---
    #: None: the embedded tiny model (random weights, answers not meaningful).
    model: str | None = None
    quantize: str | None = None  # None or "nf4"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp16 on CUDA, fp32 on CPU) | float32 | float16 | bfloat16
    trust_remote_code: bool = False
    cache_dir: Path = field(default_factory=default_cache_dir)
    #: Tokeniser truncation: prompts longer than this many tokens are cut, never padded up.
    max_input_tokens: int = 512

    # --- request limits (client mistakes beyond these get a 4xx, never a 500) ---
    #: 20 MiB covers a 12 MP JPEG from a phone camera with room to spare.
    max_image_bytes: int = 20 * 1024 * 1024
    #: 50 MP: above any phone photo; a 50000x50000 "bomb" (2.5 GP) is refused before decoding.
    max_image_pixels: int = 50_000_000
    max_prompt_chars: int = 2000
    max_new_tokens_limit: int = 256
    #: A corrupted stream that hangs the decoder is cut after this long (504).
    decode_timeout_s: float = 10.0
    #: Reading an image's header takes microseconds, and a crafted one (19 MB of JPEG fill
    #: bytes, a million empty PNG chunks) is refused by count in milliseconds (422). A probe
    #: not answered within this long waited for a thread or the CPU: 503, a retry may work.
    header_timeout_s: float = 1.0

    # --- image_url fetching ---
    #: Empty: any public host. Otherwise only these host names.
    allowed_hosts: tuple[str, ...] = ()
    fetch_timeout_s: float = 5.0
    max_redirects: int = 3
    #: Tests only: allow loopback URLs (the test's own HTTP server). Never in production.
    allow_loopback_fetch_for_tests: bool = False

    # --- concurrency and overload ---
    #: Requests running the model at once (one GPU: one generate at a time is the norm).
    max_concurrency: int = 2
    #: Requests waiting for a slot; beyond this the answer is 429 with Retry-After.
    max_queue: int = 32
    retry_after_s: int = 1
    preprocess_workers: int = 2

    # --- chain ---
    ocr: str = "auto"  # auto (on when tesseract is installed) | on | off

    # --- cache ---
    cache_max_entries: int = 1024
    cache_max_bytes: int = 16 * 1024 * 1024
    cache_ttl_s: float = 600.0

    # --- connections ---
    #: A connection must complete its request head (request line and headers, a few hundred
    #: bytes) within this long of opening, or of its previous response: ample for a real
    #: client on a poor mobile link, and the most a slowloris client holds a connection.
    #: (Not the image ``header_timeout_s`` above: this one is HTTP's.)
    http_header_timeout_s: float = 10.0
    #: The longest pause between two chunks of a request body before 408: an upload over a
    #: poor link pauses for seconds; one silent for 30 s has stopped.
    http_body_timeout_s: float = 30.0
    #: Idle time between requests on a keep-alive connection (uvicorn's default). Behind a
    #: proxy that reuses connections, set it above the proxy's idle timeout (an AWS ALB's is
    #: 60 s), or the proxy may send a request down a connection the service is closing.
    #: The header timeout runs between requests too, so an idle connection closes at the
    #: smaller of the two: raise both together.
    keep_alive_timeout_s: float = 5.0
    #: Open connections per process (uvicorn's limit_concurrency): from this many on, a new
    #: request gets 503. Far above what max_concurrency + max_queue can serve, so real clients
    #: never meet it; low enough that a flood meets it before the open-file limit.
    max_connections: int = 1024
    #: Requests a second one connection may send, sustained, and at once (a token bucket);
    #: past that the service reads its next request only when the budget allows — no error,
    #: TCP holds the client back. A VLM request takes 0.1-1 s, so a real connection carries a
    #: few a second (behind a proxy, one request at a time each); only /health, /metrics and
    #: errors can come faster, and 40 at once covers any client's burst of those. A client
    #: looping on cheap requests (bench_isolation's header flood: 90,000 valid 13 KB heads
    #: answered in 20 s) is held to 20 a second per connection.
    http_pace_rate: float = 20.0
    http_pace_burst: int = 40

    # --- logging ---
    json_logs: bool = False


#: Environment variable that carries the settings (as :func:`settings_to_json`) from
#: ``python -m mrc_agent.reference_service --workers N`` to each uvicorn worker's app factory.
ENV_SETTINGS = "MRC_SERVICE_SETTINGS"


def settings_to_json(s: Settings) -> str:
    """For handing settings to uvicorn worker processes through the environment."""
    import json
    from dataclasses import asdict

    d = asdict(s)
    d["cache_dir"] = str(s.cache_dir)
    d["allowed_hosts"] = list(s.allowed_hosts)
    return json.dumps(d)


def settings_from_json(text: str) -> Settings:
    import json

    d = json.loads(text)
    d["cache_dir"] = Path(d["cache_dir"])
    d["allowed_hosts"] = tuple(d["allowed_hosts"])
    return Settings(**d)
