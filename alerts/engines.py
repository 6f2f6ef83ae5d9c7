"""The engines' own view beside the client's: vLLM's, SGLang's and TGI's native metrics recorded
as a few ``mrc:engine_*`` series, whichever of its names the running version exports.

The meter (docs/openai-meter.md) times a request from its first byte; an engine starts its clock
when its frontend hands the request over, after the upload and the request's parsing, and each
engine names, labels and deprecates its metrics its own way. These rules put the engines' time to
first token, queue time, KV-cache usage and multimodal-cache hits under one set of names with an
``engine`` label (``vllm``, ``sglang``, ``tgi``), so the service dashboard can draw the engine's
TTFT next to the client's: the difference is the time the engine cannot see.

:data:`SOURCES` says where every name comes from (repository and file), which names are current
and which deprecated, and where an engine has no such metric; docs/engines.md is the same table
for people, and ``tests/integration/test_engine_rules.py`` keeps the two and the rules in
step. Names were read from the engines' sources, not guessed: vllm-project/vllm
(``vllm/v1/metrics/loggers.py``, ``vllm/engine/metrics.py``), sgl-project/sglang
(``python/sglang/srt/observability/metrics_collector.py``, formerly
``python/sglang/srt/metrics/collector.py``), huggingface/text-generation-inference
(``router/src/server.rs``, ``backends/v3/src``).

How the rules stay right across versions:

* **current or deprecated**: ``current or deprecated`` after both are aggregated to the same
  label set, so a version that exports both (vLLM 0.9 and 0.10 export ``vllm:kv_cache_usage_perc``
  and ``vllm:gpu_cache_usage_perc`` with equal values) gives one series, the current one;
* **one server, one series**: labels that tell apart parts of one server (:data:`PARTS`: vLLM's
  engine-core index under data parallelism, SGLang's TP/PP/DP/EP ranks) are summed away from
  rates and maxed away from usage gauges (the fullest KV cache is the one that refuses
  requests); every other label stays, target labels and ``model_name`` included. vLLM's own
  ``engine`` label is that engine-core index: it is summed away before ``engine`` is set to the
  engine's name;
* **histograms as bucket rates**, with ``_sum`` and ``_count`` rates beside them: a quantile
  over any grouping is then one ``histogram_quantile`` on few series, and the mean (``_sum`` over
  ``_count``) subtracts exactly, which quantiles do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from mrc_agent.alerts.config import Config, Thresholds

VLLM, SGLANG, TGI = "vllm", "sglang", "tgi"
ENGINES = (VLLM, SGLANG, TGI)

#: Labels that tell apart parts of one engine server rather than servers, by engine.
PARTS: dict[str, tuple[str, ...]] = {
    # vLLM V1 labels every series model_name and engine, the engine-core index ("0", "1", ...
    # under --data-parallel-size); V0 only model_name.
    VLLM: ("engine",),
    # SGLang's scheduler labels model_name, engine_type, tp_rank, pp_rank, moe_ep_rank and, with
    # data parallelism, dp_rank; its tokenizer model_name (and engine_type in recent versions).
    SGLANG: ("tp_rank", "pp_rank", "dp_rank", "moe_ep_rank"),
    # TGI's router labels none of these families.
    TGI: (),
}

TTFT, QUEUE, KV, MM_HITS, MM_QUERIES = ("time to first token", "queue time", "KV-cache usage",
                                        "multimodal-cache hits", "multimodal-cache queries")
SIGNALS = (TTFT, QUEUE, KV, MM_HITS, MM_QUERIES)
CURRENT, DEPRECATED, NONE = "current", "deprecated", "none"

_VLLM_REPO, _SGLANG_REPO, _TGI_REPO = ("vllm-project/vllm", "sgl-project/sglang",
                                       "huggingface/text-generation-inference")
_VLLM_V1 = ("vllm/v1/metrics/loggers.py",)
_VLLM_V0 = ("vllm/engine/metrics.py",)
_VLLM_BOTH = _VLLM_V1 + _VLLM_V0
#: SGLang moved its collectors from the first path to the second; the names stayed.
_SGLANG = ("python/sglang/srt/metrics/collector.py",
           "python/sglang/srt/observability/metrics_collector.py")


@dataclass(frozen=True)
class EngineSource:
    """One engine's metric for one signal, as its source declares it."""

    engine: str
    signal: str
    #: The name PromQL reads: a histogram's base name (``_bucket``, ``_sum``, ``_count`` follow),
    #: a counter's exposed name with ``_total``. None where the engine has no such metric.
    name: str | None
    kind: str
    repository: str
    #: The files that declare it (or, for NONE, where its neighbours are declared).
    paths: tuple[str, ...]
    status: str
    note: str


SOURCES: tuple[EngineSource, ...] = (
    EngineSource(
        VLLM, TTFT, "vllm:time_to_first_token_seconds", "histogram", _VLLM_REPO, _VLLM_BOTH,
        CURRENT,
        "the same name in the V1 and the V0 engine; counted from the frontend's arrival time, so "
        "the engine's own input processing is inside it"),
    EngineSource(
        VLLM, QUEUE, "vllm:request_queue_time_seconds", "histogram", _VLLM_REPO, _VLLM_BOTH,
        CURRENT,
        "the WAITING phase: queued to scheduled"),
    EngineSource(
        VLLM, QUEUE, "vllm:time_in_queue_requests", "histogram", _VLLM_REPO, _VLLM_V0, DEPRECATED,
        "V0 engine only, deprecated in 0.8 for vllm:request_queue_time_seconds, and every "
        "version that has it exports that one beside it: not read"),
    EngineSource(
        VLLM, KV, "vllm:kv_cache_usage_perc", "gauge", _VLLM_REPO, _VLLM_V1, CURRENT,
        "0 to 1 despite the name (\"1 means 100 percent usage\")"),
    EngineSource(
        VLLM, KV, "vllm:gpu_cache_usage_perc", "gauge", _VLLM_REPO, _VLLM_V0 + _VLLM_V1,
        DEPRECATED,
        "the V0 name; deprecated in 0.9 for vllm:kv_cache_usage_perc, exported beside it with "
        "the same value until it went behind --show-hidden-metrics-for-version"),
    EngineSource(
        VLLM, MM_HITS, "vllm:mm_cache_hits_total", "counter", _VLLM_REPO, _VLLM_V1, CURRENT,
        "declared vllm:mm_cache_hits; multimodal items found in the processor cache; no older "
        "name"),
    EngineSource(
        VLLM, MM_QUERIES, "vllm:mm_cache_queries_total", "counter", _VLLM_REPO, _VLLM_V1, CURRENT,
        "declared vllm:mm_cache_queries; multimodal items looked up"),
    EngineSource(
        SGLANG, TTFT, "sglang:time_to_first_token_seconds", "histogram", _SGLANG_REPO, _SGLANG,
        CURRENT,
        "TokenizerMetricsCollector; counted from the tokenizer manager's receipt"),
    EngineSource(
        SGLANG, QUEUE, "sglang:queue_time_seconds", "histogram", _SGLANG_REPO, _SGLANG, CURRENT,
        "SchedulerMetricsCollector; the first versions with metrics (late 2024) have no "
        "queue-time histogram, and there the series stays empty"),
    EngineSource(
        SGLANG, KV, "sglang:token_usage", "gauge", _SGLANG_REPO, _SGLANG, CURRENT,
        "0 to 1; recent versions report the fullest of the full-attention, SWA and Mamba pools"),
    EngineSource(
        SGLANG, MM_HITS, "sglang:encoder_cache_hit_files_total", "counter", _SGLANG_REPO,
        _SGLANG[1:], CURRENT,
        "EncoderMetricsCollector: only an EPD encoder server (--encoder-only, --enable-metrics) "
        "has it (sgl-project/sglang#27564), labelled by modality; created at the first hit, so "
        "until then hits read 0"),
    EngineSource(
        SGLANG, MM_QUERIES, "sglang:encoder_cache_total_files_total", "counter", _SGLANG_REPO,
        _SGLANG[1:], CURRENT,
        "files (multimodal items) looked up, hit or miss"),
    EngineSource(
        TGI, TTFT, None, "histogram", _TGI_REPO, ("router/src/server.rs",), NONE,
        "no time-to-first-token metric: tgi_request_duration is the whole request"),
    EngineSource(
        TGI, QUEUE, "tgi_request_queue_duration", "histogram", _TGI_REPO, ("router/src/server.rs",),
        CURRENT,
        "seconds; recorded when a request succeeds, so failed requests are not in it"),
    EngineSource(
        TGI, KV, "tgi_batch_current_max_tokens", "gauge", _TGI_REPO, ("backends/v3/src/backend.rs",
        "backends/v2/src/backend.rs"), CURRENT,
        "the tokens the running batch will grow to (its prompts and max_new_tokens; \"Maximum "
        "number of tokens this batch will grow to\", proto/v3/generate.proto)"),
    EngineSource(
        TGI, KV, "tgi_batch_max_total_tokens", "gauge", _TGI_REPO, ("backends/v3/src/lib.rs",),
        CURRENT,
        "max_batch_total_tokens, the token budget warmup sizes to the free KV memory; since "
        "v2.3.1 (huggingface/text-generation-inference#2595). The ratio of the two is the share "
        "of the budget the batch has reserved, not measured occupancy"),
    EngineSource(
        TGI, MM_HITS, None, "counter", _TGI_REPO, ("router/src/server.rs",), NONE,
        "no multimodal (or prefix) cache metric"),
)


def sources(engine: str | None = None, signal: str | None = None) -> list[EngineSource]:
    """The rows of :data:`SOURCES` for ``engine`` and ``signal`` (None: any)."""
    return [s for s in SOURCES if engine in (None, s.engine) and signal in (None, s.signal)]


@dataclass(frozen=True)
class EngineQueries:
    """Expressions and recording-rule names of the engine rules for one config."""

    cfg: Config

    @property
    def _t(self) -> Thresholds:
        return self.cfg.thresholds

    @property
    def _w(self) -> str:
        # The request-side window: enough requests for a quantile, the same window as the
        # service rules, so the engine's view and the client's cover the same requests.
        return self._t.request_rate_window

    def _m(self, metric: str) -> str:
        return metric + self.cfg.sel()

    @staticmethod
    def _name(engine: str, signal: str, status: str = CURRENT) -> str:
        (source,) = [s for s in sources(engine, signal) if s.status == status]
        assert source.name is not None
        return source.name

    @staticmethod
    def _without(op: str, engine: str, *more: str) -> str:
        return f"{op} without ({', '.join((*PARTS[engine], *more))})"

    @staticmethod
    def _as(engine: str, expr: str) -> str:
        """``expr`` with ``engine="<engine>"``: indented, one argument per line."""
        inner = "\n".join(f"  {line}" for line in expr.splitlines())
        return f'label_replace(\n{inner},\n  "engine", "{engine}", "", ""\n)'

    def _any(self, parts: dict[str, str]) -> str:
        return "\nor\n".join(self._as(engine, expr) for engine, expr in parts.items())

    # --- histograms ----------------------------------------------------------------------------

    def _histogram_engines(self, signal: str) -> list[str]:
        return [e for e in ENGINES if any(s.status == CURRENT for s in sources(e, signal))]

    def histogram(self, signal: str, part: str) -> str:
        """The recorded name of ``part`` (``bucket``, ``sum``, ``count``) of ``signal``."""
        metric = {TTFT: "time_to_first_token", QUEUE: "queue_time"}[signal]
        return f"mrc:engine_{metric}_seconds_{part}:rate{self._w}"

    def histogram_expr(self, signal: str, part: str) -> str:
        return self._any({
            engine: f"{self._without('sum', engine)} "
                    f"(rate({self._m(f'{self._name(engine, signal)}_{part}')}[{self._w}]))"
            for engine in self._histogram_engines(signal)})

    # --- KV cache ------------------------------------------------------------------------------

    @property
    def kv_usage(self) -> str:
        return "mrc:engine_kv_cache_usage_ratio:max"

    def kv_usage_expr(self) -> str:
        vllm = (f"{self._without('max', VLLM)} ({self._m(self._name(VLLM, KV))})\n"
                f"or\n"
                f"{self._without('max', VLLM)} ({self._m(self._name(VLLM, KV, DEPRECATED))})")
        used, budget = (s.name for s in sources(TGI, KV))
        assert used is not None and budget is not None
        return self._any({
            VLLM: vllm,
            SGLANG: f"{self._without('max', SGLANG)} ({self._m(self._name(SGLANG, KV))})",
            TGI: f"{self._m(used)}\n/\n{self._m(budget)}",
        })

    # --- multimodal cache ----------------------------------------------------------------------

    @property
    def mm_hits(self) -> str:
        return f"mrc:engine_mm_cache_hits:rate{self._w}"

    @property
    def mm_queries(self) -> str:
        return f"mrc:engine_mm_cache_queries:rate{self._w}"

    @property
    def mm_hit_ratio(self) -> str:
        return f"mrc:engine_mm_cache_hits:ratio_rate{self._w}"

    def _mm_rate(self, engine: str, signal: str) -> str:
        # SGLang's counters carry a modality label vLLM's do not: summed, as vLLM counts items
        # of every modality together.
        more = ("modality",) if engine == SGLANG else ()
        return (f"{self._without('sum', engine, *more)} "
                f"(rate({self._m(self._name(engine, signal))}[{self._w}]))")

    def mm_hits_expr(self) -> str:
        # SGLang creates its hit counter at the first hit: until then its hits are 0, not
        # missing, or the hit ratio of a cold cache would be no data instead of 0.
        return self._any({
            VLLM: self._mm_rate(VLLM, MM_HITS),
            SGLANG: f"{self._mm_rate(SGLANG, MM_HITS)}\nor\n"
                    f"0 * {self._mm_rate(SGLANG, MM_QUERIES)}",
        })

    def mm_queries_expr(self) -> str:
        return self._any({engine: self._mm_rate(engine, MM_QUERIES) for engine in (VLLM, SGLANG)})

    def mm_hit_ratio_expr(self) -> str:
        # From the two rates recorded just before it; no series while nothing is looked up.
        return f"{self.mm_hits}\n/\n({self.mm_queries} > 0)"

    # --- all -----------------------------------------------------------------------------------

    def recording_rules(self) -> list[tuple[str, str]]:
        """``(record, expr)`` of every engine rule, in evaluation order."""
        out = [(self.histogram(signal, part), self.histogram_expr(signal, part))
               for signal in (TTFT, QUEUE) for part in ("bucket", "sum", "count")]
        out += [(self.kv_usage, self.kv_usage_expr()),
                (self.mm_hits, self.mm_hits_expr()),
                (self.mm_queries, self.mm_queries_expr()),
                # After the two rates: it reads them in the same evaluation.
                (self.mm_hit_ratio, self.mm_hit_ratio_expr())]
        return out


def markdown_table() -> str:
    """:data:`SOURCES` as the Markdown table of docs/engines.md (which a test keeps equal)."""
    rows = ["| engine | signal | name | type | status | declared in | note |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in SOURCES:
        paths = ", ".join(f"`{p}`" for p in s.paths)
        rows.append(f"| {s.engine} | {s.signal} | {f'`{s.name}`' if s.name else '–'} | "
                    f"{s.kind if s.name else '–'} | {s.status} | {s.repository}: {paths} | "
                    f"{s.note} |")
    return "\n".join(rows) + "\n"
