"""Benchmark: the OpenAI meter's scan cost per byte, whatever the bytes and their chunking.

Run as ``python3 benchmarks/bench_meter_scan.py [--quick] [--out FILE]``. A measurement, not a
test: it prints a Markdown table, writes it to ``--out`` and exits 0 whether or not the goals are
met.

Goals, so that the scans cost time linear in the bytes whatever the bytes are:

* the request scan (:class:`~mrc_agent.exporters.instrumentation.meter.ChatRequestScan`) costs
  at most 5x as much per byte for a prompt made of JSON escapes (``\\u00e9``, ``\\n``, ``\\"``)
  as for plain text, fed in 64 KiB chunks, in 1 KiB pieces or in one piece; the middleware
  runs this scan in the server's event loop, so its cost per byte is latency for every request
  on that loop;
* the event scan (:class:`~mrc_agent.exporters.instrumentation.meter.EventScan`) is linear in
  an event's size however it is written: a 60 KB event written a byte at a time costs at most
  2x as much per byte as a 6 KB one (a copy and a search of the whole event per piece made it
  10x, quadratic). The 1-byte / 1 KiB ratio is shown too: a call per byte costs a Python call
  per byte, a constant no scan removes.

Each figure is the best of a few runs (``time.perf_counter``, in process, no HTTP): the cost of
the scan alone, the floor the machine allows. A 1 MB body is a chat request whose one text part
holds the prompt: plain words, or escapes only (an escaped quote every 10 bytes, or none). The
event is one ``data:`` line carrying a 60 KB ``delta.content``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from support import host, parser, report

from mrc_agent.exporters.instrumentation import MRCMetrics
from mrc_agent.exporters.instrumentation.meter import ChatRequestScan, EventScan, Exchange

BODY_BYTES = 1 << 20
EVENT_BYTES = 60_000
GOAL_RATIO = 5.0
GOAL_LINEAR = 2.0
#: Each figure is the best of runs adding up to about this long (at least one run).
RUN_BUDGET_S = 0.5


def request_body(prompt_unit: str) -> bytes:
    """A chat request of about :data:`BODY_BYTES` whose one text part repeats ``prompt_unit``."""
    encoded = len(json.dumps(prompt_unit)) - 2
    text = prompt_unit * (BODY_BYTES // encoded)
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}]}], "stream": True}).encode()


def event(size: int) -> bytes:
    """One server-sent event of about ``size`` bytes: a content delta on one ``data:`` line."""
    filler = "w" * (size - 80)
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {
        "content": filler}}]}).encode() + b"\n\n"


def best_ns_per_byte(run: Callable[[], None], nbytes: int, budget: float) -> float:
    """The fastest of a few runs of ``run``, in nanoseconds per byte of ``nbytes``."""
    best = float("inf")
    spent = 0.0
    while spent < budget or best == float("inf"):
        t0 = time.perf_counter()
        run()
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
    return best / nbytes * 1e9


def scan_request(body: bytes, piece: int) -> Callable[[], None]:
    def run() -> None:
        scan = ChatRequestScan()
        for at in range(0, len(body), piece):
            scan.feed(body[at:at + piece])
        scan.close()
        assert scan.failed is None and scan.prompt_chars > 0, scan.failed
    return run


def scan_event(data: bytes, piece: int) -> Callable[[], None]:
    metrics = MRCMetrics(resolution_unknown=True)
    pieces = [data[at:at + piece] for at in range(0, len(data), piece)]

    def run() -> None:
        exchange = Exchange(metrics)
        scan = EventScan(exchange)
        for p in pieces:
            scan.feed(p)
        scan.close()
        assert scan.events == 1
        exchange.finish()
    return run


def main() -> int:
    ap = parser(__doc__, "one run per figure")
    args = ap.parse_args()
    budget = 0.0 if args.quick else RUN_BUDGET_S

    plain = request_body("lorem ipsum dolor sit amet ")
    # ensure_ascii (json.dumps' default) writes é as \u00e9: each prompt is all escapes. The
    # second holds no quote, so a search for the string's end runs to the end of the chunk.
    quoted = request_body('\u00e9\n"')
    unquoted = request_body("\u00e9\n\t")
    rows = ["| request scan, fed as | plain (ns/B) | escapes with \\\" (ns/B) | escapes, no quote "
            "(ns/B) | worst / plain | goal |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, piece in (("64 KiB chunks", 64 * 1024), ("1 KiB pieces", 1024),
                        ("one piece", len(quoted))):
        p = best_ns_per_byte(scan_request(plain, piece), len(plain), budget)
        q = best_ns_per_byte(scan_request(quoted, piece), len(quoted), budget)
        u = best_ns_per_byte(scan_request(unquoted, piece), len(unquoted), budget)
        ratio = max(q, u) / p
        verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
        rows.append(f"| {name} | {p:.2f} | {q:.2f} | {u:.2f} | **{ratio:.1f}x** | "
                    f"<= {GOAL_RATIO:g}x: {verdict} |")

    rows += ["", "| event scan | 1 KiB pieces (ns/B) | 1-byte pieces (ns/B) | 1-byte / 1 KiB |",
             "| --- | ---: | ---: | ---: |"]
    per_byte = []
    for size in (EVENT_BYTES // 10, EVENT_BYTES):
        data = event(size)
        kib = best_ns_per_byte(scan_event(data, 1024), len(data), budget)
        one = best_ns_per_byte(scan_event(data, 1), len(data), budget)
        per_byte.append(one)
        rows.append(f"| one event of {len(data)} B | {kib:.1f} | {one:.1f} | {one / kib:.1f}x |")
    growth = per_byte[1] / per_byte[0]
    verdict = "met" if growth <= GOAL_LINEAR else "NOT met"
    rows += ["", f"Event written a byte at a time, 10x larger: **{growth:.1f}x** the cost per "
             f"byte (goal <= {GOAL_LINEAR:g}x, linear): {verdict}."]
    text = "\n".join([
        "# OpenAI meter: scan cost per byte", "",
        "Generated by `python3 benchmarks/bench_meter_scan.py`"
        + (" --quick" if args.quick else "") + "; best of runs, in process.", "",
        *rows, "",
        f"{host()}.",
    ])
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
