"""NVLink: which links are active, and their cumulative TX/RX byte counters.

Links are discovered once per NVML session (the result is kept on the :class:`Gpu`), then
every device sample fetches all links' TX and RX throughput fields in one
``nvmlDeviceGetFieldValues`` call. A GPU without an active link keeps its NVLink fields
``None``: absent series, never zeros.
"""

from __future__ import annotations

import logging
from typing import Any

from mrc_agent.agent.core.hw.base import DeviceSample
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, union_value, unsupported_codes
from mrc_agent.agent.core.hw.nvml.units import nvlink_kib_to_bytes

log = logging.getLogger(__name__)


class NvlinkCounters:
    """Discovers each GPU's active links and reads their counters into device samples."""

    def __init__(self, memo: Memo) -> None:
        self._memo = memo

    def active_links(self, lib: Any, gpu: Gpu) -> list[int]:
        """The GPU's active link indices, discovered on the first call of the session."""
        if gpu.nvlinks is None:
            gpu.nvlinks = self._discover(lib, gpu)
        return gpu.nvlinks

    def read(self, lib: Any, gpu: Gpu, s: DeviceSample) -> None:
        """Set ``s``'s per-link and summed NVLink byte counters (left absent without links)."""
        links = self.active_links(lib, gpu)
        if not links:
            return
        tx_id, rx_id = (
            lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        )
        # scopeId selects the link; one call fetches every link's TX and RX together.
        request = [(tx_id, link) for link in links] + [(rx_id, link) for link in links]
        values = self._memo.optional(
            lib, gpu, "nvlink_throughput", lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, request)
        )
        if values is None:
            return
        tx: dict[int, float] = {}
        rx: dict[int, float] = {}
        for value in list(values)[: len(request)]:
            kib = self._field_value(
                lib, gpu, value, f"nvlink_field_{value.fieldId}_link_{value.scopeId}"
            )
            if kib is None:
                continue
            (tx if value.fieldId == tx_id else rx)[int(value.scopeId)] = nvlink_kib_to_bytes(kib)
        per_link = {link: (tx[link], rx[link]) for link in links if link in tx and link in rx}
        if per_link:
            s.nvlink_links = per_link
            s.nvlink_tx_bytes_total = sum(t for t, _ in per_link.values())
            s.nvlink_rx_bytes_total = sum(r for _, r in per_link.values())

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
