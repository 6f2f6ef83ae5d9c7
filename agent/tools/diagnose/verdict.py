"""The verdict: what the CPU and the GPU did over the window (:func:`analyse_cpu`,
:func:`analyse_gpu`), where the lines are drawn (:class:`Rules`), and :func:`decide`, first match
wins: preprocessing-bound, cpu-bound, transfer-bound, memory-bound or healthy, and
inconclusive when the target exited before the window's end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mrc_agent.agent.core.collectors import derived, gpm, gpu, process, profiling
from mrc_agent.agent.core.collectors.base import GPU, DerivedThresholds
from mrc_agent.agent.core.sample import Reading, Snapshot, readings
from mrc_agent.agent.tools.diagnose.sampling import IdleWindows, _WindowTracker
from mrc_agent.exporters.exposition.snapshot import MetricSpec


@dataclass(frozen=True)
class Rules:
    """Where the verdict's lines are drawn, and why.

    ``image_share`` 0.5: image code must be on the busy thread's stack in most of its samples,
    not just show up. ``gpu_idle_fraction`` 0.5: "mostly idle" is idle (at or below the agent's
    idle threshold) in more than half of the fine-grained utilisation points; a mean would put
    a GPU bursting at 97 % for a fifth of the time right on the agent's 0.2 starvation line.
    ``gpu_waiting_util`` 0.5: the alerts' "busy" line (alerts/config.py ``gpu_busy_ratio``);
    below it the GPU waits for something. ``pcie_busy`` 20 GB/s per direction is ~60 % of a PCIe
    Gen4 x16 link and ~30 % of Gen5; an MRC service moves a few GB/s of images, so more,
    sustained, means the link paces the work. ``nvlink_busy`` 225 GB/s per direction is half of
    H100/H200 NVLink (450 GB/s). ``instructions_per_byte`` 8 and ``gpm_sm_to_dram`` 1.2 are the
    alerts' memory-bound lines (alerts/config.py): the roofline ridge on Hopper, and its GPM
    activity stand-in.
    """

    image_share: float = 0.5
    gpu_idle_fraction: float = 0.5
    gpu_waiting_util: float = 0.5
    pcie_busy_bytes_per_second: float = 20e9
    nvlink_busy_bytes_per_second: float = 225e9
    instructions_per_byte: float = 8.0
    gpm_sm_to_dram: float = 1.2


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _values(snaps: Sequence[Snapshot], spec: MetricSpec,
            **match: str) -> list[tuple[float, Reading]]:
    """(snapshot time, reading) of every numeric sample of ``spec`` matching ``match``."""
    return [(snap.timestamp, r) for snap in snaps for r in readings(snap, spec, **match)
            if isinstance(r.value, (int, float))]


def _num(r: Reading) -> float:
    assert isinstance(r.value, (int, float))
    return float(r.value)


def _per_gpu_mean(snaps: Sequence[Snapshot], spec: MetricSpec,
                  gpus: set[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    acc: dict[tuple[str, ...], list[float]] = {}
    for _, r in _values(snaps, spec):
        if r.key(GPU) in gpus:
            acc.setdefault(r.key(GPU), []).append(_num(r))
    return {g: sum(vs) / len(vs) for g, vs in acc.items()}


def _per_gpu_rate(snaps: Sequence[Snapshot], spec: MetricSpec,
                  gpus: set[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    """Increase of a cumulative per-GPU counter per second over the window, per GPU."""
    seen: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    for t, r in _values(snaps, spec):
        if r.key(GPU) in gpus:
            seen.setdefault(r.key(GPU), []).append((t, _num(r)))
    out = {}
    for g, points in seen.items():
        (t0, v0), (t1, v1) = points[0], points[-1]
        if t1 > t0 and v1 >= v0:
            out[g] = (v1 - v0) / (t1 - t0)
    return out


def _per_gpu_delta(snaps: Sequence[Snapshot], spec: MetricSpec,
                   gpus: set[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    seen: dict[tuple[str, ...], list[float]] = {}
    for _, r in _values(snaps, spec):
        if r.key(GPU) in gpus:
            seen.setdefault(r.key(GPU), []).append(_num(r))
    return {g: vs[-1] - vs[0] for g, vs in seen.items() if len(vs) > 1}


#: Per direction: NVML's PCIe throughput, GPM's PCIe rate, GPM's NVLink rate, NVLink counter.
_PCIE = {"tx": (gpu.PCIE_TX, gpm.PCIE_TX), "rx": (gpu.PCIE_RX, gpm.PCIE_RX)}
_NVLINK = {"tx": (gpm.NVLINK_TX, gpu.NVLINK_TX), "rx": (gpm.NVLINK_RX, gpu.NVLINK_RX)}


def analyse_gpu(snaps: Sequence[Snapshot], pid: int, idle: IdleWindows | None,
                reasons: dict[str, str], start: float) -> dict[str, Any]:
    """What the GPU did over the window, for the GPUs the target uses (all when none is
    attributed to it)."""
    all_gpus = {r.key(GPU) for _, r in _values(snaps, gpu.UTILIZATION)}
    if not all_gpus:
        reason = reasons.get("gpu") or "no GPU utilisation samples"
        return {"available": False, "reason": reason}
    mine = {r.key(GPU) for _, r in _values(snaps, gpu.PROCESS_MEMORY_USED, pid=str(pid))}
    gpus = mine or all_gpus
    util_mean = _per_gpu_mean(snaps, gpu.UTILIZATION, gpus)
    per_gpu: dict[str, dict[str, Any]] = {}
    idle_fraction: dict[tuple[str, ...], float] = {}
    windows: list[dict[str, Any]] = []
    trackers: dict[tuple[str, ...], _WindowTracker] = (
        {} if idle is None else {gid.labels: t for gid, t in idle.trackers.items()})
    threshold = DerivedThresholds.idle_util if idle is None else idle.threshold
    for g in sorted(gpus):
        tracker = trackers.get(g)
        points = tracker.points if tracker else []
        if points:
            fine_mean = sum(u for _, u in points) / len(points)
            idle_fraction[g] = sum(1 for _, u in points if u <= threshold) / len(points)
        else:  # no fine-grained points: the per-pass readings stand in
            fine_mean = util_mean.get(g, 0.0)
            idle_fraction[g] = 1.0 if fine_mean <= threshold else 0.0
        if tracker:
            for a, b in tracker.windows:
                windows.append({"gpu": g[0], "start_seconds": round(a - start, 3),
                                "end_seconds": round(b - start, 3),
                                "duration_seconds": round(b - a, 3)})
            if tracker.idle_since is not None and points:
                end = points[-1][0]
                windows.append({"gpu": g[0], "start_seconds": round(tracker.idle_since - start, 3),
                                "end_seconds": round(end - start, 3),
                                "duration_seconds": round(end - tracker.idle_since, 3),
                                "open": True})
        per_gpu[g[0]] = {"uuid": g[1], "model": g[2], "utilization_mean": _r(fine_mean),
                         "idle_fraction": _r(idle_fraction[g]), "utilization_points": len(points)}
    pcie = {}
    for direction, (nvml_spec, gpm_spec) in _PCIE.items():
        nvml_rate = _per_gpu_mean(snaps, nvml_spec, gpus)
        gpm_rate = _per_gpu_mean(snaps, gpm_spec, gpus)
        pcie[direction] = {**gpm_rate, **nvml_rate}
    nvlink = {}
    for direction, (gpm_spec, counter_spec) in _NVLINK.items():
        gpm_rate = _per_gpu_mean(snaps, gpm_spec, gpus)
        counted = _per_gpu_rate(snaps, counter_spec, gpus)
        nvlink[direction] = {**counted, **gpm_rate}
    sm_active = _per_gpu_mean(snaps, gpm.SM_ACTIVE, gpus)
    dram_bw = _per_gpu_mean(snaps, gpm.DRAM_BANDWIDTH, gpus)
    proxy = _per_gpu_mean(snaps, gpm.SM_TO_DRAM_ACTIVITY, gpus)
    inst = _per_gpu_delta(snaps, profiling.SM_INSTRUCTIONS, gpus)
    dram = _per_gpu_delta(snaps, profiling.DRAM_READ_BYTES, gpus)
    inst_per_byte = {g: inst[g] / dram[g] for g in inst if dram.get(g, 0) > 0}
    for g in gpus:
        row = per_gpu[g[0]]
        row["pcie_tx_bytes_per_second"] = _r(pcie["tx"].get(g), 0)
        row["pcie_rx_bytes_per_second"] = _r(pcie["rx"].get(g), 0)
        row["nvlink_tx_bytes_per_second"] = _r(nvlink["tx"].get(g), 0)
        row["nvlink_rx_bytes_per_second"] = _r(nvlink["rx"].get(g), 0)
        row["sm_active_mean"] = _r(sm_active.get(g))
        row["dram_bandwidth_utilization_mean"] = _r(dram_bw.get(g))
        row["gpm_sm_to_dram_activity_mean"] = _r(proxy.get(g))
        row["sm_instructions_per_dram_byte"] = _r(inst_per_byte.get(g), 3)
    starved = [_num(r) for _, r in _values(snaps, derived.STARVED, pid=str(pid))]

    def worst(d: dict[tuple[str, ...], float], pick: Callable[..., float]) -> float | None:
        vals = [v for g, v in d.items() if g in gpus]
        return pick(vals) if vals else None

    if inst_per_byte:
        source = profiling.SOURCE_PROFILING
    elif proxy or dram_bw:
        source = profiling.SOURCE_GPM
    else:
        source = profiling.SOURCE_NONE
    return {
        "available": True,
        "gpus": per_gpu,
        "attributed": bool(mine),
        # The least idle of the target's GPUs decides, like the starvation signal.
        "idle_fraction": _r(min(idle_fraction.values())),
        "utilization_mean": _r(max(r["utilization_mean"] or 0.0 for r in per_gpu.values())),
        "idle_windows": windows,
        "starved_fraction": _r(_mean(starved)),
        "pcie_bytes_per_second": _r(worst({g: max(pcie["tx"].get(g, 0.0), pcie["rx"].get(g, 0.0))
                                           for g in gpus if g in pcie["tx"] or g in pcie["rx"]},
                                          max), 0),
        "nvlink_bytes_per_second": _r(worst(
            {g: max(nvlink["tx"].get(g, 0.0), nvlink["rx"].get(g, 0.0))
             for g in gpus if g in nvlink["tx"] or g in nvlink["rx"]}, max), 0),
        "sm_active_mean": _r(worst(sm_active, max)),
        "compute_memory": {
            "source": source,
            "sm_instructions_per_dram_byte": _r(worst(inst_per_byte, min), 3),
            "gpm_sm_to_dram_activity": _r(worst(proxy, min)),
            "dram_bandwidth_utilization": _r(worst(dram_bw, max)),
            "profiling_reason": reasons.get("profiling", ""),
        },
    }


def analyse_cpu(snaps: Sequence[Snapshot], pid: int, threshold: float,
                hottest_runnable: dict[str, float] | None = None) -> dict[str, Any]:
    """Mean user CPU of the process and of its hottest thread over the window; hot when either,
    or the hottest thread's runnable share (see :func:`runnable`), reaches ``threshold``."""

    def mine(spec: MetricSpec) -> list[Reading]:
        return [r for _, r in _values(snaps, spec, pid=str(pid))]

    user = [_num(r) for r in mine(process.CPU_USER_RATIO)]
    system = [_num(r) for r in mine(process.CPU_SYSTEM_RATIO)]
    hottest = [_num(r) for r in mine(process.HOTTEST_THREAD_USER_RATIO)]
    names = [r.labels["process"] for r in mine(process.THREADS)]
    u, h = _mean(user), _mean(hottest)
    peak = max(u or 0.0, h or 0.0)
    run = hottest_runnable or {}
    hot = (bool(user) and peak >= threshold) or run.get("runnable_ratio", 0.0) >= threshold
    return {"process": names[-1] if names else "", "user_ratio_mean": _r(u),
            "system_ratio_mean": _r(_mean(system)), "hottest_thread_user_ratio_mean": _r(h),
            "hottest_thread_runnable_ratio": _r(run.get("runnable_ratio")),
            "hottest_thread_waiting_ratio": _r(run.get("waiting_ratio")),
            "node_steal_ratio": _r(run.get("steal_ratio")),
            "threshold": threshold, "hot": hot, "windows": len(user)}


@dataclass
class Verdict:
    verdict: str
    summary: str
    evidence: list[str] = field(default_factory=list)


def _gb(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e9:.2f} GB/s"


def decide(cpu: dict[str, Any], gpu: dict[str, Any], stacks: dict[str, Any],
           rules: Rules = Rules()) -> Verdict:
    """The verdict, first match wins:

    1. ``preprocessing-bound``: target CPU hot (user CPU of the process or of its hottest
       thread, or the hottest thread's runnable share of the window, at or above the
       starvation CPU threshold), the GPU mostly idle or not measured, and image code
       (decode/resize/convert…) on the busy thread's stack in most samples;
    2. ``cpu-bound``: the same, but the stacks are not image code;
    3. ``transfer-bound``: PCIe or NVLink busy while the GPU waits (utilisation or SM activity
       below the busy line);
    4. ``memory-bound``: the GPU is not mostly idle and computes few instructions per DRAM byte
       (profiling counters), or, without them, the GPM activity proxy says so (named as such);
    5. ``healthy``: none of these.
    """
    ev: list[str] = []
    cpu_line = (f"target CPU: user {cpu['user_ratio_mean']} cores, hottest thread "
                f"{cpu['hottest_thread_user_ratio_mean']}")
    if cpu.get("hottest_thread_runnable_ratio") is not None:
        cpu_line += (f", hottest thread runnable {cpu['hottest_thread_runnable_ratio']} of the "
                     f"window (waiting for a CPU {cpu['hottest_thread_waiting_ratio']})")
    cpu_line += f" (hot at >= {cpu['threshold']})"
    ev.append(cpu_line + (" -> hot" if cpu["hot"] else " -> not hot"))
    share = stacks.get("image_share", 0.0)
    top = stacks["top_self"][0]["frame"] if stacks.get("top_self") else "none"
    said = "stacks"
    if stacks.get("source") == "agent":
        said = f"stacks (the agent's own, from {-stacks.get('from_seconds', 0):g} s before)"
    if stacks.get("busy_thread_samples"):
        ev.append(f"{said}: {stacks['busy_thread_samples']} samples on the busiest thread, "
                  f"{stacks['busy_thread']}; top self frame {top}; image code on the stack in "
                  f"{share:.0%} of them (line {rules.image_share:.0%})")
    else:
        ev.append(f"{said}: no samples, the target ran no Python code in the window")
    if stacks.get("image_frames"):
        ev.append("image frames: " + ", ".join(f"{k} ({n})" for k, n in stacks["image_frames"]))
    gpu_idle = True
    if not gpu.get("available"):
        ev.append(f"no GPU data ({gpu.get('reason', 'unknown')}): judged from CPU and stacks "
                  "only")
    else:
        gpu_idle = (gpu["idle_fraction"] or 0.0) >= rules.gpu_idle_fraction
        windows = gpu["idle_windows"]
        longest = max((w["duration_seconds"] for w in windows), default=0.0)
        ev.append(f"GPU: idle {gpu['idle_fraction']:.0%} of the window (mostly idle at >= "
                  f"{rules.gpu_idle_fraction:.0%}), mean utilisation {gpu['utilization_mean']}, "
                  f"{len(windows)} idle windows, longest {longest:.2f} s"
                  + ("" if gpu["attributed"] else "; no GPU memory attributed to the target, "
                     "all GPUs considered"))
        if gpu.get("starved_fraction") is not None:
            ev.append(f"agent starvation signal on {gpu['starved_fraction']:.0%} of passes")
    if cpu["hot"] and gpu_idle:
        if share >= rules.image_share:
            return Verdict("preprocessing-bound",
                           f"CPU-side image preprocessing starves the GPU: {top}", ev)
        return Verdict("cpu-bound", f"CPU-bound outside image code: {top}", ev)
    if gpu.get("available"):
        util = gpu["utilization_mean"] or 0.0
        sm = gpu.get("sm_active_mean")
        waiting = util < rules.gpu_waiting_util or (sm is not None and sm < rules.gpu_waiting_util)
        pcie, nvlink = gpu.get("pcie_bytes_per_second"), gpu.get("nvlink_bytes_per_second")
        ev.append(f"transfers: PCIe {_gb(pcie)} (busy at {_gb(rules.pcie_busy_bytes_per_second)}),"
                  f" NVLink {_gb(nvlink)} (busy at {_gb(rules.nvlink_busy_bytes_per_second)}) "
                  f"per direction; GPU {'waiting' if waiting else 'busy'} (utilisation {util}, "
                  f"SM active {sm})")
        busy_link = ((pcie or 0.0) >= rules.pcie_busy_bytes_per_second
                     or (nvlink or 0.0) >= rules.nvlink_busy_bytes_per_second)
        if busy_link and waiting:
            return Verdict("transfer-bound", "the GPU waits on PCIe/NVLink transfers", ev)
        cm = gpu["compute_memory"]
        if cm["source"] == "cupti_pm_sampling":
            ipb = cm["sm_instructions_per_dram_byte"]
            ev.append(f"compute per memory (profiling counters): {ipb} SM instructions per DRAM "
                      f"byte (memory-bound below {rules.instructions_per_byte:g})")
            memory_bound = ipb is not None and ipb < rules.instructions_per_byte
        elif cm["source"] == "gpm_activity_proxy":
            q = cm["gpm_sm_to_dram_activity"]
            ev.append(f"compute per memory (GPM activity proxy, not an instruction count): SM "
                      f"activity / DRAM bandwidth utilisation {q} (memory-bound below "
                      f"{rules.gpm_sm_to_dram:g}); profiling counters: "
                      f"{cm['profiling_reason'] or 'not available'}")
            memory_bound = q is not None and q < rules.gpm_sm_to_dram
        else:
            ev.append("compute per memory: no profiling counters and no GPM data")
            memory_bound = False
        if memory_bound and not gpu_idle:
            how = ("profiling counters" if cm["source"] == "cupti_pm_sampling"
                   else "GPM activity proxy")
            return Verdict("memory-bound", f"GPU kernels are memory-bound ({how})", ev)
    return Verdict("healthy", "no bottleneck found in this window", ev)

