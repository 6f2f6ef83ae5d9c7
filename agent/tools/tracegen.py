"""Synthetic replay traces for the demo, the tests and the benchmarks, recorded from the
simulated GPU.

A pattern says what the GPUs do, step by step, in the project's units; :class:`SimulatedNode`
writes that into the one simulated ``pynvml`` and ``cupti`` (``agent/tools/simgpu``) in their
own units, and ``mrc-agent record``'s recorder reads them through the agent's real adapters
(``NvmlBackend``, ``CuptiPmSampler``) on a virtual clock, so a trace of any length is written at
once and says exactly what a recording of such a GPU would. The traces are labelled synthetic
in their GPU UUIDs (``GPU-synthetic-…``) so that nobody mistakes them for a recording.
Recordings from real GPUs (``mrc-agent record``) live in ``tests/data/``; the demo's embedded
trace (``agent/tools/data/demo_starved.jsonl``) is ``python -m mrc_agent.agent.tools.tracegen
starved 1 12``, and a test checks it still is.

Patterns:
- ``starved``: the GPU runs a 0.6 s burst every 3 s and idles in between (a CPU-bound
  preprocessing thread feeds it), NVLink quiet, PCIe bursts with each batch.
- ``busy``: a steady memory-bound decode: utilisation ~0.95, DRAM busy, NVLink ~120 GB/s.
- ``low_nvlink``: busy GPU whose NVLink moves only ~10 GB/s.

``mig=N`` puts every GPU in MIG mode with N MIG devices (GPU instances 1..N, one compute
instance each): NVML then answers utilisation and GPM per GPU instance only, and CUPTI
profiles no MIG GPU, so the GPU's own row carries neither and its MIG devices' rows carry
their memory and their instance's GPM.

What the simulated GPU does not have (clocks, temperature, ECC, PCIe replays, XID events)
answers NOT_SUPPORTED, so those fields are absent from the trace, as on a GPU without them.
"""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from mrc_agent.agent.core.hw.base import GPUIdentity
from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.nvml.gpm import MIN_GPM_INTERVAL_S
from mrc_agent.agent.core.hw.sources import Sources
from mrc_agent.agent.tools.record import record
from mrc_agent.agent.tools.simgpu.cupti import ClockedCupti
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu, mig_device, nvlink, pynvml

PATTERNS = ("starved", "busy", "low_nvlink")
H200_MEMORY = 143_771_000_832  # bytes NVML reports on an H200 141 GB
#: An H200 has at most seven GPU instances.
MAX_MIG_DEVICES = 7
#: NVLink links of an H200 (NVLink 4); NVML counts each link's bytes, in KiB.
H200_NVLINK_LINKS = 18
#: The hardware interval the CUPTI PM sampler runs at (the agent's default, 0.1 s), or the
#: trace's step when that is shorter.
PROFILING_INTERVAL_S = 0.1
#: What the simulated GPU answers NOT_SUPPORTED (module docstring).
NOT_SUPPORTED = frozenset({
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPcieReplayCounter",
})
#: GPM metric name -> the activity key it reports (NVML's unit: percent).
GPM_METRICS = {
    "NVML_GPM_METRIC_SM_UTIL": "sm_util",
    "NVML_GPM_METRIC_SM_OCCUPANCY": "sm_occupancy",
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": "tensor_util",
    "NVML_GPM_METRIC_DRAM_BW_UTIL": "dram_bw_util",
}
#: The cumulative quantities, integrated from their rates (``<name>_rate`` in an activity):
#: ``busy`` is the seconds the GPU was active, the integral of its utilisation.
CUMULATIVE = ("nvlink_tx", "nvlink_rx", "instructions", "dram_read", "busy")
_KIB = 1024.0


def activity(pattern: str, t: float, gpu_index: int) -> dict[str, float]:
    """What GPU ``gpu_index`` does at time ``t`` under ``pattern``, in the project's units
    (ratios 0-1, bytes, bytes and instructions per second, watts)."""
    if pattern == "starved":
        busy = (t % 3.0) < 0.6
        util = 0.97 if busy else 0.0
        nvlink_rate = 2e9 if busy else 0.0
        pcie_rx = 6e9 if busy else 2e7
        sm, dram, tensor = (0.8, 0.35, 0.5) if busy else (0.0, 0.0, 0.0)
        inst_rate, dram_rate = (4.0e12, 1.2e12) if busy else (0.0, 0.0)
    else:
        wobble = 0.02 * math.sin(t * 2.0 + gpu_index)
        util = 0.95 + wobble
        nvlink_rate = 1.2e11 if pattern == "busy" else 1.0e10
        pcie_rx = 1.5e9
        sm, dram, tensor = 0.9, 0.85 + wobble, 0.3
        inst_rate, dram_rate = 9.0e12, 3.0e12  # ~3 instructions per byte: memory-bound
    return {
        "gpu_util": util, "sm_util": sm, "sm_occupancy": sm * 0.6, "tensor_util": tensor,
        "dram_bw_util": dram, "mem_used_bytes": 60e9 + gpu_index * 1e9,
        "pcie_tx_bytes_per_second": pcie_rx * 0.1, "pcie_rx_bytes_per_second": pcie_rx,
        "power_watts": 180.0 + 450.0 * util,
        "nvlink_tx_rate": nvlink_rate, "nvlink_rx_rate": nvlink_rate * 0.9,
        "instructions_rate": inst_rate, "dram_read_rate": dram_rate, "busy_rate": util,
    }


class VirtualClock:
    """The trace's clock: stands still until :meth:`sleep` moves it on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        # Rounded, so that the recorder's ticks land on its grid and do not drift.
        self.now = round(self.now + max(seconds, 0.0), 9)

    def fast(self) -> float:
        """This clock run a part in 10^9 fast: on it, two ticks exactly ``interval`` apart are
        at least ``interval`` apart in floating point too (0.6 - 0.4 is 0.19999999999999996),
        so GPM, which skips a window shorter than its interval, takes one every 0.2 s."""
        return self.now * (1 + 1e-9)


class SimulatedNode:
    """``gpus`` simulated H200s doing ``pattern``, step by step: each step's activity holds from
    its start until the next, and the counters integrate it. ``nvml`` and ``cupti`` are the
    simulated libraries answering for them on ``clock``."""

    def __init__(self, pattern: str, gpus: int, step: float, mig: int,
                 clock: VirtualClock) -> None:
        self.pattern, self.step, self.mig, self.clock = pattern, step, mig, clock
        self._steps: list[list[dict[str, float]]] = [[] for _ in range(gpus)]
        # Per GPU and quantity: the integral up to the start of each step computed so far.
        self._sums: list[dict[str, list[float]]] = [{k: [0.0] for k in CUMULATIVE}
                                                    for _ in range(gpus)]
        self.nvml = FakeNvml([self._gpu(i) for i in range(gpus)],
                             driver_version="synthetic", nvml_version="synthetic",
                             cuda_driver_version=12080)
        self.nvml.not_supported = set(NOT_SUPPORTED)
        self.nvml.clock = clock
        self.nvml.refresh = self._refresh
        self.nvml.gpm_between = self._gpm_between
        self._gpm_ids = {int(getattr(pynvml, name)): key for name, key in GPM_METRICS.items()}
        #: Per GPU, the moment its dicts were last written: a sample makes many calls at one
        #: moment, and the readings are a function of the moment alone.
        self._written: dict[int, float] = {}
        self.cupti = ClockedCupti([self.uuid(i) for i in range(gpus)], clock,
                                  lambda i, t: self.total(i, "instructions", t),
                                  lambda i, t: self.total(i, "dram_read", t),
                                  busy_seconds=lambda i, t: self.total(i, "busy", t))

    @staticmethod
    def uuid(index: int) -> str:
        return f"GPU-synthetic-{index:04d}"

    def _gpu(self, index: int) -> dict[str, Any]:
        migs = [mig_device(k + 1, uuid=f"MIG-synthetic-{index:04d}-{k + 1:02d}",
                           memory={"total": H200_MEMORY // MAX_MIG_DEVICES, "used": 0,
                                   "reserved": 0})
                for k in range(self.mig)]
        return gpu(uuid=self.uuid(index), name="NVIDIA H200 (synthetic)",
                   memory={"total": H200_MEMORY, "used": 0, "reserved": 0},
                   nvlink={link: nvlink() for link in range(H200_NVLINK_LINKS)},
                   gpm={}, mig=migs, compute_capability=(9, 0), architecture="HOPPER")

    def _index(self, t: float) -> int:
        return max(0, math.floor(t / self.step + 1e-9))

    def at(self, index: int, t: float) -> dict[str, float]:
        """GPU ``index``'s activity in the step that holds time ``t``."""
        k, steps = self._index(t), self._steps[index]
        while len(steps) <= k:
            steps.append(activity(self.pattern, len(steps) * self.step, index))
        return steps[k]

    def total(self, index: int, name: str, t: float) -> float:
        """The integral of ``<name>_rate`` from 0 to ``t``."""
        k, sums = self._index(t), self._sums[index][name]
        while len(sums) <= k:
            sums.append(sums[-1] + self.at(index, (len(sums) - 1) * self.step)[name + "_rate"]
                        * self.step)
        return sums[k] + self.at(index, t)[name + "_rate"] * max(0.0, t - k * self.step)

    def _refresh(self, name: str, index: int) -> None:
        """That moment's readings, in NVML's units, just before a call on GPU ``index``."""
        now, data = self.clock(), self.nvml.gpus[index]
        if self._written.get(index) == now:
            return
        self._written[index] = now
        a = self.at(index, now)
        data["util"] = {"gpu": round(100 * a["gpu_util"]), "memory": round(100 * a["dram_bw_util"])}
        data["memory"]["used"] = int(a["mem_used_bytes"])
        data["pcie"].update(tx_kb_per_s=int(a["pcie_tx_bytes_per_second"] / _KIB),
                            rx_kb_per_s=int(a["pcie_rx_bytes_per_second"] / _KIB))
        data["power_mw"] = round(1000 * a["power_watts"])
        tx, rx = (self.total(index, q, now) for q in ("nvlink_tx", "nvlink_rx"))
        for link in data["nvlink"].values():
            link.update(tx_kib=int(tx / H200_NVLINK_LINKS / _KIB),
                        rx_kib=int(rx / H200_NVLINK_LINKS / _KIB))
        for m in data["mig"]:  # a MIG device's GPM is its instance's, read as it is now
            m["memory"]["used"] = int(a["mem_used_bytes"] / MAX_MIG_DEVICES)
            m["gpm"] = {metric: round(100.0 * a[key], 6) for metric, key in self._gpm_ids.items()}

    def _gpm_between(self, index: int, t0: float, t1: float) -> dict[int, float]:
        """GPM's percentages over the window between two samples: the steps' mean."""
        k0, k1 = self._index(t0), max(self._index(t1 - 1e-9), self._index(t0))
        parts = [(min(t1, (k + 1) * self.step) - max(t0, k * self.step),
                  self.at(index, k * self.step)) for k in range(k0, k1 + 1)]
        span = sum(w for w, _ in parts) or 1.0
        return {metric: round(100.0 * sum(w * a[key] for w, a in parts) / span, 6)
                for metric, key in self._gpm_ids.items()}


def write_trace(out: TextIO, gpus: int = 1, duration: float = 12.0, step: float = 0.1,
                pattern: str = "starved", mig: int = 0) -> int:
    """Write ``duration / step`` samples per GPU (and per MIG device with ``mig``), recorded
    through the agent's adapters from :class:`SimulatedNode`; returns the number of lines."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}")
    if not 0 <= mig <= MAX_MIG_DEVICES:
        raise ValueError(f"mig must be 0-{MAX_MIG_DEVICES}, not {mig}")
    if not (step > 0 and duration >= step):
        raise ValueError(f"need 0 < step <= duration, not step {step!r}, duration {duration!r}")
    clock = VirtualClock()
    node = SimulatedNode(pattern, gpus, step, mig, clock)
    nvml = NvmlBackend(lib=node.nvml, clock=clock, wall_clock=clock, pcie_thread=False,
                       gpm_interval=MIN_GPM_INTERVAL_S, gpm_clock=clock.fast,
                       sample_clocks={"realtime": clock})
    profiling = None if mig else CuptiPmSampler(
        [GPUIdentity(i, node.uuid(i), "NVIDIA H200 (synthetic)") for i in range(gpus)],
        lib=node.cupti, interval_s=min(step, PROFILING_INTERVAL_S), clock=clock,
        sample_clocks={"monotonic": clock})  # the simulated samples are stamped on it

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        nvml.run_background_round()  # what its PCIe thread would have read meanwhile

    nvml.run_background_round()
    sources = Sources(nvml, nvml, profiling, tuple(p for p in (nvml, profiling) if p))
    try:
        # The recorder samples at 0, step, ... up to its duration inclusive: just short of
        # ``duration`` gives ``duration / step`` samples.
        return record(sources, out, duration - step / 2, step, clock=clock, sleep=sleep,
                      err=sys.stderr)
    finally:
        sources.close()


if __name__ == "__main__":  # python -m mrc_agent.agent.tools.tracegen PATTERN GPUS DURATION [MIG]
    pat, n, dur = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    write_trace(sys.stdout, gpus=n, duration=dur, pattern=pat,
                mig=int(sys.argv[4]) if len(sys.argv) > 4 else 0)
