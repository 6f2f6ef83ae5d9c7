"""promtool unit test of the engine recording rules (:mod:`mrc_agent.alerts.engines`), on the
engines' own expositions.

``alerts/tests/engines/*.prom`` are text expositions written from the engines' metric
definitions: names, help, types, labels and buckets as vLLM's, SGLang's and TGI's sources declare
them, rendered the way each engine renders them (prometheus-client for vLLM and SGLang,
metrics-exporter-prometheus for TGI), with synthetic values; each file's header says which
source and version it follows. Each file is one scrape target, read as what the server shows
ten minutes after it started at a steady rate: counters and histograms climb from 0 to the
file's value in ten one-minute steps, gauges hold theirs. So a 5m rate is value / 600 and every
expectation below is arithmetic on the files' numbers, written out by hand (the numbers are
chosen so that it is exact in binary: promtool 2.42 compares values exactly).

Together the files cover every name a rule reads, current and deprecated: vLLM's V0 engine
(``vllm:gpu_cache_usage_perc`` only), 0.10 (both KV-cache names), a recent V1 engine with data
parallelism (``engine="0"``, ``"1"``) and the multimodal-cache counters; SGLang from late 2024 (no
queue histogram) and recent with data parallelism, and its EPD encoder with and without a first
cache hit; a vLLM server that has looked no multimodal item up (its hit ratio is 0 / 0, so it
has none); TGI (no TTFT). ``python -m mrc_agent.alerts.unit_tests`` writes the test file,
``alerts/tests/engines.yaml``, with the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

#: The expositions, beside the generated test files.
FIXTURES = Path(__file__).resolve().parent / "tests" / "engines"
ENGINES_FILE = "engines.yaml"
#: Minutes of steady traffic the expositions show; the test evaluates at the end of them.
MINUTES = 10
_RAMPED = ("counter", "histogram", "summary")


def target(stem: str) -> dict[str, str]:
    """The labels Prometheus adds to the fixture ``stem``'s series (one pod per file)."""
    return {"job": "engines", "namespace": "mrc", "pod": stem, "instance": f"{stem}:8000"}


def _s(metric: str, labels: dict[str, str]) -> str:
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def series(path: Path) -> dict[str, str]:
    """promtool input series of one exposition file: counters and histograms climb to the
    file's values over :data:`MINUTES`, gauges (and created timestamps) hold theirs."""
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            name = _s(sample.name, {**target(path.stem), **sample.labels})
            if family.type in _RAMPED and not sample.name.endswith("_created"):
                out[name] = f"0+{_num(sample.value / MINUTES)}x{MINUTES}"
            else:
                out[name] = f"{_num(sample.value)}x{MINUTES}"
    return out


def fixtures() -> list[Path]:
    return sorted(FIXTURES.glob("*.prom"))


# --- expectations --------------------------------------------------------------------------------

_LLAVA = "llava-hf/llava-1.5-7b-hf"
_QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"


def _at(stem: str, **labels: str) -> dict[str, str]:
    return {**target(stem), **labels}


# The labels each fixture's series keep once the engine's parts are aggregated away.
V1 = _at("vllm-v1", model_name=_LLAVA, engine="vllm")            # engine="0"/"1" summed
V010 = _at("vllm-0.10", model_name=_QWEN, engine="vllm")
V0 = _at("vllm-v0", model_name=_LLAVA, engine="vllm")
SG_TOKENIZER = _at("sglang", model_name=_QWEN, engine_type="unified", engine="sglang")
SG_SCHEDULER = SG_TOKENIZER                                       # tp/pp/ep/dp ranks dropped
SG2024 = _at("sglang-2024", model_name="llava-hf/llava-onevision-qwen2-7b-ov-hf",
             engine="sglang")
ENCODER = _at("sglang-encoder", model_name=_QWEN, engine="sglang")  # dp_rank, modality summed
COLD = _at("sglang-encoder-cold", model_name=_QWEN, engine="sglang")
TEXT = _at("vllm-text", model_name=_LLAVA, engine="vllm")          # no lookup: no hit ratio
TGI = _at("tgi", engine="tgi")

Expected = list[tuple[dict[str, str], float]]

#: Recording rule -> every sample it must give at the end of the ten minutes (promtool fails on
#: a missing or an extra one: a TGI TTFT, a second vLLM 0.10 KV series, a series per engine core).
EXPECTED: dict[str, Expected] = {
    # vllm-v1: 600 + 600 first tokens on two engine cores; sum 121.875 + 75 s.
    "mrc:engine_time_to_first_token_seconds_count:rate5m": [
        (V1, 2.0), (V010, 0.5), (V0, 1.0), (SG_TOKENIZER, 1.0), (SG2024, 0.25)],
    "mrc:engine_time_to_first_token_seconds_sum:rate5m": [
        (V1, 0.328125), (V010, 0.0625), (V0, 0.375), (SG_TOKENIZER, 0.375), (SG2024, 0.09375)],
    # vllm-v1: 600 + 600 queued (150 + 300 s); sglang: dp 0 300 x 0.0625 s, dp 1 300 x 0.375 s.
    "mrc:engine_queue_time_seconds_count:rate5m": [
        (V1, 2.0), (V010, 0.5), (V0, 1.0), (SG_SCHEDULER, 1.0), (TGI, 1.0)],
    "mrc:engine_queue_time_seconds_sum:rate5m": [
        (V1, 0.75), (V010, 0.125), (V0, 0.375), (SG_SCHEDULER, 0.21875), (TGI, 0.0322265625)],
    # The fullest engine core or DP rank; TGI 12288 of 49152 budget tokens.
    "mrc:engine_kv_cache_usage_ratio:max": [
        (V1, 0.75), (V010, 0.5), (V0, 0.375), (SG_SCHEDULER, 0.875), (SG2024, 0.25), (TGI, 0.25)],
    "mrc:engine_mm_cache_hits:rate5m": [(V1, 1.5), (ENCODER, 0.375), (COLD, 0.0), (TEXT, 0.0)],
    "mrc:engine_mm_cache_queries:rate5m": [(V1, 2.0), (ENCODER, 2.0), (COLD, 1.0),
                                           (TEXT, 0.0)],
    "mrc:engine_mm_cache_hits:ratio_rate5m": [(V1, 0.75), (ENCODER, 0.1875), (COLD, 0.0)],
    # Bucket rates: checked by the queries below.
    "mrc:engine_time_to_first_token_seconds_bucket:rate5m": [],
    "mrc:engine_queue_time_seconds_bucket:rate5m": [],
}


def _pods(counts: dict[str, int]) -> list[dict[str, Any]]:
    return [{"labels": _s("", {"pod": pod}), "value": n} for pod, n in counts.items()]


def _sample(name: str, labels: dict[str, str], value: float) -> dict[str, Any]:
    return {"labels": _s(name, labels), "value": value}


_TTFT_BUCKETS = "mrc:engine_time_to_first_token_seconds_bucket:rate5m"
_QUEUE_BUCKETS = "mrc:engine_queue_time_seconds_bucket:rate5m"
_TGI_LE = "0.0025628906249999996"  # the TGI bucket between its 300 fast and 300 slow requests

#: The bucket rules: one series per bucket of each engine version's own boundaries (vLLM V1 22
#: + Inf, V0 16 + Inf; SGLang 18 + Inf, 2024 20 + Inf, its queue 36 + Inf; TGI 35 + Inf), so
#: neither a duplicate nor a mix of two histograms, and their values.
BUCKET_CHECKS: list[tuple[str, list[dict[str, Any]]]] = [
    (f"count by (pod) ({_TTFT_BUCKETS})",
     _pods({"vllm-v1": 23, "vllm-0.10": 23, "vllm-v0": 17, "sglang": 19, "sglang-2024": 21})),
    (f'{_TTFT_BUCKETS}{{pod="vllm-v1",le=~"0.06|0.08|0.25|\\\\+Inf"}}',
     [_sample(_TTFT_BUCKETS, {**V1, "le": le}, v)
      for le, v in (("0.06", 0.0), ("0.08", 0.25), ("0.25", 1.75), ("+Inf", 2.0))]),
    (f"count by (pod) ({_QUEUE_BUCKETS})",
     _pods({"vllm-v1": 22, "vllm-0.10": 22, "vllm-v0": 16, "sglang": 37, "tgi": 36})),
    (f'{_QUEUE_BUCKETS}{{pod=~"sglang|tgi",le=~"0.1|0.5|{_TGI_LE}|\\\\+Inf"}}',
     [_sample(_QUEUE_BUCKETS, {**labels, "le": le}, v)
      for labels, le, v in ((SG_SCHEDULER, "0.1", 0.5), (SG_SCHEDULER, "0.5", 1.0),
                            (SG_SCHEDULER, "+Inf", 1.0), (TGI, _TGI_LE, 0.5),
                            (TGI, "+Inf", 1.0))]),
]


def engine_tests(rule_file: Path | str) -> dict[str, Any]:
    """The engine rules' promtool test file, against ``rule_file``."""
    input_series: dict[str, str] = {}
    for path in fixtures():
        input_series.update(series(path))
    checks = [(name, [_sample(name, labels, value) for labels, value in want])
              for name, want in EXPECTED.items() if want]
    checks += BUCKET_CHECKS
    return {"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": [{
        "name": "engines: every version's names into mrc:engine_*",
        "interval": "1m",
        "input_series": [{"series": k, "values": v} for k, v in input_series.items()],
        "promql_expr_test": [{"expr": expr, "eval_time": f"{MINUTES}m", "exp_samples": samples}
                             for expr, samples in checks],
    }]}
