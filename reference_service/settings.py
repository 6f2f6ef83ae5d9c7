"""The reference service's settings: one typed object with every limit in one place.

Each limit says why it is what it is. A limit offered as a flag of ``python -m
mrc_agent.reference_service`` (and ``mrc-agent serve``) is declared once with :func:`setting`:
its flag, ``--help`` text and range check follow from that, by the project's one settings
mechanism (:mod:`mrc_agent.exporters.settings`), as do the flags of the server itself
(:class:`ServerSettings`). Tests build :class:`Settings` directly; uvicorn's worker processes
get them as JSON in ``MRC_SERVICE_SETTINGS``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrc_agent.exporters.settings import (
    ConfigError,
    Declarations,
    number,
    setting,
    text,
    whole,
    yes_no,
)

#: The flags of ``python -m mrc_agent.reference_service`` are this command's.
SERVE = "serve"
#: Above an hour a connection deadline is no deadline; a typo (ms for s) more likely.
MAX_TIMEOUT_S = 3600
#: Far above any one process's useful share of a host's open files.
MAX_CONNECTIONS = 1_000_000
#: Requests a second (and at once) per connection: beyond this, pacing is no pacing.
MAX_PACE = 1_000_000


def default_cache_dir() -> Path:
    """Where the embedded model is built once and reused (``$MRC_CACHE_DIR`` or XDG cache)."""
    base = os.environ.get("MRC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mrc-agent")
    return Path(base)


def _path(value: Any, _cfg: Any) -> Path:
    return Path(value)


def _hosts(value: Any, _cfg: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _counted(value: int, name: str) -> None:
    """At least one (a port: 0-65535)."""
    low, high = (0, 65535) if name == "port" else (1, None)
    if value < low or (high is not None and value > high):
        raise ConfigError(f"--{name.replace('_', '-')} {value} is out of range")


def _seconds(flag: str) -> Any:
    def check(value: float, _name: str) -> None:
        if not 0 < value <= MAX_TIMEOUT_S:  # also refuses nan and inf
            raise ConfigError(f"{flag} {value:g} is out of range (above 0, at most "
                              f"{MAX_TIMEOUT_S} s)")
    return check


def _up_to(flag: str, high: int) -> Any:
    def check(value: float, _name: str) -> None:
        if isinstance(value, float):
            if not 0 < value <= high:  # also refuses nan and inf
                raise ConfigError(f"{flag} {value:g} is out of range (above 0, at most {high})")
        elif not 1 <= value <= high:
            raise ConfigError(f"{flag} {value} is out of range (1-{high})")
    return check


_S = (SERVE,)


@dataclass
class ServerSettings:
    """How the server process meets the network: not the app's, so not in :class:`Settings`."""

    host: str = setting("127.0.0.1", parse=text, commands=_S, help="address to listen on")
    port: int = setting(8000, parse=whole, check=_counted, commands=_S, help="port to listen on")
    workers: int = setting(
        1, parse=whole, check=_counted, commands=_S,
        help="uvicorn worker processes (metrics use prometheus-client's multiprocess mode "
             "when > 1)")
    log_level: str = setting("info", parse=text, commands=_S,
                             choices=("debug", "info", "warning", "error"), help="log level")


@dataclass
class Settings:
    # --- model ---
    #: None: the embedded tiny model (random weights, answers not meaningful).
    model: str | None = setting(parse=text, commands=_S, metavar="PATH",
                                default_text="the embedded tiny model, random weights",
                                help="local checkpoint")
    quantize: str | None = setting(parse=text, commands=_S, choices=("nf4",),
                                   help="quantise the weights on load")
    device: str = setting("auto", parse=text, commands=_S, help="auto, cpu, cuda or cuda:N")
    #: auto: fp16 on CUDA, fp32 on CPU.
    dtype: str = setting("auto", parse=text, commands=_S,
                         choices=("auto", "float32", "float16", "bfloat16"),
                         help="weights' dtype (auto: float16 on CUDA, float32 on CPU)")
    trust_remote_code: bool = setting(False, parse=yes_no, commands=_S, toggle=True,
                                      help="run the checkpoint's own model code")
    cache_dir: Path = setting(
        default_factory=default_cache_dir, parse=_path, commands=_S,
        default_text="$MRC_CACHE_DIR, else $XDG_CACHE_HOME/mrc-agent or ~/.cache/mrc-agent",
        help="where the embedded model is built once and reused")
    #: Tokeniser truncation: prompts longer than this many tokens are cut, never padded up.
    max_input_tokens: int = 512

    # --- request limits (client mistakes beyond these get a 4xx, never a 500) ---
    #: 20 MiB covers a 12 MP JPEG from a phone camera with room to spare.
    max_image_bytes: int = setting(20 * 1024 * 1024, parse=whole, check=_counted,
                                   commands=_S, help="largest image upload, in bytes")
    #: 50 MP: above any phone photo; a 50000x50000 "bomb" (2.5 GP) is refused before decoding.
    max_image_pixels: int = 50_000_000
    max_prompt_chars: int = setting(2000, parse=whole, check=_counted, commands=_S,
                                    help="longest prompt, in characters")
    max_new_tokens_limit: int = setting(256, parse=whole, check=_counted, commands=_S,
                                        help="most new tokens a request may ask for")
    #: A corrupted stream that hangs the decoder is cut after this long (504).
    decode_timeout_s: float = 10.0
    #: Reading an image's header takes microseconds, and a crafted one (19 MB of JPEG fill
    #: bytes, a million empty PNG chunks) is refused by count in milliseconds (422). A probe
    #: not answered within this long waited for a thread or the CPU: 503, a retry may work.
    header_timeout_s: float = 1.0

    # --- image_url fetching ---
    #: Empty: any public host. Otherwise only these host names.
    allowed_hosts: tuple[str, ...] = setting(
        (), parse=_hosts, commands=_S, flag="--allowed-host", repeatable=True,
        default_text="any public host", help="image_url hosts to allow, one a flag")
    fetch_timeout_s: float = 5.0
    max_redirects: int = 3
    #: Tests only: allow loopback URLs (the test's own HTTP server). Never in production.
    allow_loopback_fetch_for_tests: bool = False

    # --- concurrency and overload ---
    #: Requests running the model at once (one GPU: one generate at a time is the norm).
    max_concurrency: int = setting(2, parse=whole, check=_counted, commands=_S,
                                   help="requests running the model at once")
    #: Requests waiting for a slot; beyond this the answer is 429 with Retry-After.
    max_queue: int = setting(32, parse=whole, check=_counted, commands=_S,
                             help="requests waiting for a slot; beyond this 429")
    retry_after_s: int = 1
    preprocess_workers: int = 2
    #: "naive" decodes whole photos and converts pixels in Python on one thread: the starved
    #: GPU the agent exists to show (reference_service/preprocess/naive.py).
    preprocess: str = setting(
        "tuned", parse=text, commands=_S, choices=("tuned", "naive"),
        help="image preprocessing: tuned (draft decode, fast resize, two threads) or naive "
             "(full decode, plain Lanczos, a Python pixel loop on one thread that holds the "
             "GIL: what mrc-agent demo runs to show a starved GPU)")

    # --- chain ---
    ocr: str = setting("auto", parse=text, commands=_S, choices=("auto", "on", "off"),
                       help="the OCR step (auto: on when tesseract is installed)")

    # --- cache ---
    cache_max_entries: int = 1024
    cache_max_bytes: int = 16 * 1024 * 1024
    cache_ttl_s: float = 600.0

    # --- connections ---
    #: A connection must complete its request head (request line and headers, a few hundred
    #: bytes) within this long of opening, or of its previous response: ample for a real
    #: client on a poor mobile link, and the most a slowloris client holds a connection.
    #: (Not the image ``header_timeout_s`` above: this one is HTTP's.)
    http_header_timeout_s: float = setting(
        10.0, parse=number, check=_seconds("--header-timeout"), commands=_S,
        flag="--header-timeout", metavar="S",
        help="close a connection whose request head is not complete this many seconds after "
             "it opened or after its previous response")
    #: The longest pause between two chunks of a request body before 408: an upload over a
    #: poor link pauses for seconds; one silent for 30 s has stopped.
    http_body_timeout_s: float = setting(
        30.0, parse=number, check=_seconds("--body-timeout"), commands=_S,
        flag="--body-timeout", metavar="S",
        help="answer 408 when a request body pauses this many seconds between chunks")
    #: Idle time between requests on a keep-alive connection (uvicorn's default). Behind a
    #: proxy that reuses connections, set it above the proxy's idle timeout (an AWS ALB's is
    #: 60 s), or the proxy may send a request down a connection the service is closing.
    #: The header timeout runs between requests too, so an idle connection closes at the
    #: smaller of the two: raise both together.
    keep_alive_timeout_s: float = setting(
        5.0, parse=number, check=_seconds("--keep-alive-timeout"), commands=_S, metavar="S",
        flag="--keep-alive-timeout",
        help="close a keep-alive connection idle this many seconds between requests")
    #: Open connections per process (uvicorn's limit_concurrency): from this many on, a new
    #: request gets 503. Far above what max_concurrency + max_queue can serve, so real clients
    #: never meet it; low enough that a flood meets it before the open-file limit.
    max_connections: int = setting(
        1024, parse=whole, check=_up_to("--max-connections", MAX_CONNECTIONS), commands=_S,
        metavar="N", help="open connections per process from which new requests get 503")
    #: Requests a second one connection may send, sustained, and at once (a token bucket);
    #: past that the service reads its next request only when the budget allows — no error,
    #: TCP holds the client back. A VLM request takes 0.1-1 s, so a real connection carries a
    #: few a second (behind a proxy, one request at a time each); only /health, /metrics and
    #: errors can come faster, and 40 at once covers any client's burst of those. A client
    #: looping on cheap requests (bench_isolation's header flood: 90,000 valid 13 KB heads
    #: answered in 20 s) is held to 20 a second per connection.
    http_pace_rate: float = setting(
        20.0, parse=number, check=_up_to("--pace-rate", MAX_PACE), commands=_S,
        flag="--pace-rate", metavar="N",
        help="requests a second one connection may send, sustained; past that its next "
             "request is read later, never refused")
    http_pace_burst: int = setting(
        40, parse=whole, check=_up_to("--pace-burst", MAX_PACE), commands=_S,
        flag="--pace-burst", metavar="N",
        help="requests one connection may send at once before --pace-rate applies")

    # --- logging ---
    json_logs: bool = setting(False, parse=yes_no, commands=_S, toggle=True,
                              help="log one JSON object a line")

    @property
    def decode_workers(self) -> int:
        """Threads that decode images: one on the naive path, as the services it stands for
        run it; else :attr:`preprocess_workers`."""
        return 1 if self.preprocess == "naive" else self.preprocess_workers


#: The flags of the server and of the service, each declared once above.
SERVER_FLAGS = Declarations(ServerSettings)
SETTINGS_FLAGS = Declarations(Settings)


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
