"""NVLink: which links are active, and their cumulative TX/RX byte counters.

Links are discovered once per NVML session (the result is kept on the :class:`Gpu`), then
every device sample fetches the TX and RX throughput fields in one ``nvmlDeviceGetFieldValues``
call: the aggregate over all links (``scopeId`` = UINT_MAX, which NVML documents for it) and
each link's own. The totals are the aggregate. Per-link series are kept only while they sum to
it: on some drivers a per-link read answers the aggregate itself, and summing those reports
the total once per link (18 times too high on an H200). Without the aggregate scope (older
drivers) the totals are the per-link sum, unless every link answers the same non-zero number,
which is the same fault: then one of them is the total and no per-link series is kept.
An aggregate refused with a code that may pass (UNKNOWN, TIMEOUT) is asked again; only
NOT_SUPPORTED-like answers, or :data:`AGGREGATE_REFUSALS` refusals in a row, switch the GPU
to per-link reads for good.
``sources["nvlink"]`` says which of these is live. A GPU without an active link keeps its
NVLink fields ``None``: absent series, never zeros.
"""

from __future__ import annotations

import logging
from typing import Any

from mrc_agent.agent.core.hw.base import DeviceSample
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, union_value, unsupported_codes
from mrc_agent.agent.core.hw.nvml.units import nvlink_kib_to_bytes

log = logging.getLogger(__name__)

#: Field answers that say the GPU or the driver failed, not the scope asked: they fail the pass
#: as the whole call failing would (the session then re-initialises).
_WHOLE_GPU_FAILURES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNINITIALIZED",
                       "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_LIB_RM_VERSION_MISMATCH")
#: nvmlFieldValue_t.scopeId asking for all links together (NVML: "UINT_MAX").
AGGREGATE_SCOPE = 0xFFFFFFFF
#: Consecutive refusals of the aggregate scope, with a code that may pass (UNKNOWN, TIMEOUT,
#: ...), after which per-link reads serve the GPU for good. NOT_SUPPORTED, NO_PERMISSION,
#: FUNCTION_NOT_FOUND and INVALID_ARGUMENT (a driver older than the scope) switch at once.
AGGREGATE_REFUSALS = 3
#: How far the per-link sum may differ from the aggregate read in the same call: the fields
#: are read one after another while traffic flows, so not to the byte.
_SUM_TOLERANCE = 0.02


class NvlinkCounters:
    """Discovers each GPU's active links and reads their counters into device samples."""

    def __init__(self, memo: Memo) -> None:
        self._memo = memo
        #: GPUs (UUIDs) whose driver refuses the aggregate scope, and those whose per-link
        #: counts did not sum to it: remembered for the process's life.
        self._no_aggregate: set[str] = set()
        #: Refusals in a row of the aggregate with a code that may pass, per GPU (UUID).
        self._refusals: dict[str, int] = {}
        self._per_link_bad: set[str] = set()

    def active_links(self, lib: Any, gpu: Gpu) -> list[int]:
        """The GPU's active link indices, discovered on the first call of the session."""
        if gpu.nvlinks is None:
            gpu.nvlinks = self._discover(lib, gpu)
        return gpu.nvlinks

    def read(self, lib: Any, gpu: Gpu, s: DeviceSample) -> None:
        """Set ``s``'s NVLink byte totals and, where they add up, per-link counters."""
        links = self.active_links(lib, gpu)
        if not links:
            return
        tx_id, rx_id = (
            lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        )
        uuid = gpu.identity.uuid
        scopes = ([] if uuid in self._no_aggregate else [AGGREGATE_SCOPE]) + links
        # One call fetches the aggregate and every link's TX and RX together.
        request = [(tx_id, scope) for scope in scopes] + [(rx_id, scope) for scope in scopes]
        values = self._memo.optional(
            lib, gpu, "nvlink_throughput", lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, request)
        )
        if values is None:
            return
        tx: dict[int, float] = {}
        rx: dict[int, float] = {}
        whole_gpu = {getattr(lib, n, None) for n in _WHOLE_GPU_FAILURES}
        refused: list[int] = []  # the aggregate's answers this pass (TX, RX): one refusal
        for value in list(values)[: len(request)]:
            scope = int(value.scopeId)
            if scope == AGGREGATE_SCOPE and value.nvmlReturn != lib.NVML_SUCCESS and (
                value.nvmlReturn not in whole_gpu
            ):
                refused.append(int(value.nvmlReturn))
                continue
            kib = self._field_value(lib, gpu, value, f"nvlink_field_{value.fieldId}_link_{scope}")
            if kib is None:
                continue
            (tx if value.fieldId == tx_id else rx)[scope] = nvlink_kib_to_bytes(kib)
        if refused:
            self._refuse_aggregate(lib, gpu, refused)
        per_link = {link: (tx[link], rx[link]) for link in links if link in tx and link in rx}
        if AGGREGATE_SCOPE in tx and AGGREGATE_SCOPE in rx:
            self._refusals.pop(uuid, None)
            s.nvlink_tx_bytes_total = tx[AGGREGATE_SCOPE]
            s.nvlink_rx_bytes_total = rx[AGGREGATE_SCOPE]
            s.sources["nvlink"] = "aggregate"
            if per_link and self._adds_up(gpu, per_link, s.nvlink_tx_bytes_total,
                                          s.nvlink_rx_bytes_total):
                s.nvlink_links = per_link
            return
        if not per_link or (uuid in self._per_link_bad and uuid not in self._no_aggregate):
            return  # per-link counts known not to sum to the aggregate: no totals this pass
        if len(per_link) > 1 and len(set(per_link.values())) == 1 and any(
            v > 0 for v in next(iter(per_link.values()))
        ):
            # Every link answering one and the same non-zero count is the aggregate, repeated.
            s.nvlink_tx_bytes_total, s.nvlink_rx_bytes_total = next(iter(per_link.values()))
            s.sources["nvlink"] = "per_link_repeats_aggregate"
            self._memo.log_once(
                log, f"nvlink_repeat:{uuid}", logging.WARNING,
                "GPU %d (%s): every NVLink link reports the same byte count; taking it as the "
                "total and dropping per-link series", gpu.index, uuid,
            )
            return
        s.nvlink_links = per_link
        s.nvlink_tx_bytes_total = sum(t for t, _ in per_link.values())
        s.nvlink_rx_bytes_total = sum(r for _, r in per_link.values())
        s.sources["nvlink"] = "per_link_sum"

    def _refuse_aggregate(self, lib: Any, gpu: Gpu, codes: list[int]) -> None:
        """The aggregate scope answered ``codes`` (TX, RX) in one pass: this pass's totals
        come from the per-link reads, and from now on where the answer will not change.

        NOT_SUPPORTED (and the other unsupported codes) and INVALID_ARGUMENT, which a driver
        older than the scope answers taking UINT_MAX for a link index, switch at once. Any other
        code (UNKNOWN, TIMEOUT, ...) may pass: the aggregate is asked again, and given up only
        after :data:`AGGREGATE_REFUSALS` in a row, since failing every pass for one field would
        lose every other reading of the GPU."""
        uuid = gpu.identity.uuid
        final = unsupported_codes(lib) | {lib.NVML_ERROR_INVALID_ARGUMENT}
        code = next((c for c in codes if c in final), codes[0])
        self._refusals[uuid] = self._refusals.get(uuid, 0) + 1
        if code not in final and self._refusals[uuid] < AGGREGATE_REFUSALS:
            log.debug("GPU %d (%s): the NVLink all-links scope answered %s (%d in a row); "
                      "asked again next pass", gpu.index, uuid, _error_name(lib, code),
                      self._refusals[uuid])
            return
        self._no_aggregate.add(uuid)
        level = logging.INFO if code in unsupported_codes(lib) else logging.WARNING
        self._memo.log_once(
            log, f"nvlink_aggregate:{uuid}", level,
            "GPU %d (%s): the NVLink all-links scope answered %s; totals from the per-link "
            "reads", gpu.index, uuid, _error_name(lib, code),
        )

    def _adds_up(
        self, gpu: Gpu, per_link: dict[int, tuple[float, float]], tx_total: float,
        rx_total: float,
    ) -> bool:
        """Whether the per-link counters sum to the aggregate (logged once when they do not)."""
        uuid = gpu.identity.uuid
        if uuid in self._per_link_bad:
            return False
        for total, summed in ((tx_total, sum(t for t, _ in per_link.values())),
                              (rx_total, sum(r for _, r in per_link.values()))):
            if abs(summed - total) > _SUM_TOLERANCE * max(total, 1.0) + 1024.0:
                self._per_link_bad.add(uuid)
                self._memo.log_once(
                    log, f"nvlink_sum:{uuid}", logging.WARNING,
                    "GPU %d (%s): NVLink per-link byte counts sum to %.0f, the aggregate is "
                    "%.0f; per-link series dropped, totals from the aggregate",
                    gpu.index, uuid, summed, total,
                )
                return False
        return True

    def _discover(self, lib: Any, gpu: Gpu) -> list[int]:
        """Active link indices; [] when the GPU has no NVLink."""
        count: int | None = None
        got = self._memo.optional(
            lib,
            gpu,
            "nvlink_link_count",
            lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, [lib.NVML_FI_DEV_NVLINK_LINK_COUNT]),
        )
        if got is not None:
            raw = self._field_value(lib, gpu, got[0], "nvlink_link_count")
            count = int(raw) if raw is not None else None
        # Without a count, probe up to the library's maximum and stop at the first link NVML
        # does not know.
        limit = count if count is not None else int(lib.NVML_NVLINK_MAX_LINKS)
        stop_codes = unsupported_codes(lib) | {lib.NVML_ERROR_INVALID_ARGUMENT}
        active: list[int] = []
        for link in range(limit):
            try:
                state = lib.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except lib.NVMLError as err:
                if err.value not in stop_codes:
                    raise
                if count is None:
                    break
                continue
            if state == lib.NVML_FEATURE_ENABLED:
                active.append(link)
        if not active:
            self._memo.log_once(
                log,
                f"nvlink:{gpu.identity.uuid}",
                logging.INFO,
                "GPU %d (%s): no active NVLink; NVLink series stay absent",
                gpu.index,
                gpu.identity.uuid,
            )
        return active

    def _field_value(self, lib: Any, gpu: Gpu, value: Any, feature: str) -> float | None:
        """The number in one nvmlFieldValue_t, or None if NVML did not support that field."""
        if value.nvmlReturn == lib.NVML_SUCCESS:
            return union_value(lib, value.valueType, value.value)
        if value.nvmlReturn in unsupported_codes(lib):
            self._memo.log_once(
                log,
                f"unsupported:{gpu.identity.uuid}:{feature}",
                logging.INFO,
                "GPU %d (%s): field %s not supported; leaving it absent",
                gpu.index,
                gpu.identity.uuid,
                feature,
            )
            return None
        # A per-field GPU_IS_LOST or similar is the same failure as a whole-call one.
        raise lib.NVMLError(value.nvmlReturn)


def _error_name(lib: Any, code: int) -> str:
    """``NVMLError``'s own text for ``code`` (e.g. "Invalid Argument"), with the code."""
    try:
        return f"{lib.NVMLError(code)} (code {code})"
    except Exception:  # a library whose error class cannot be built from a code
        return f"code {code}"
