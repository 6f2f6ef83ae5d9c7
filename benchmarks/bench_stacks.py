"""Benchmark: what continuous stack sampling costs the target and the agent, side by side.

The reference service (embedded model, CPU) runs under closed-loop clients (each sends its next
upload when the previous answer arrives: a 640x480 photo, a short question, 4 new tokens). An
``mrc-agent run`` watches it, by turns without and with ``--collector stacks`` (austin at the
default 10 Hz), in A/B/B/A order so that a drift of the machine over the run falls on both
sides. Per phase:

- the service's throughput: answers per second;
- the agent's CPU: user + system seconds per second of the agent and its austin child, read
  from ``/proc``.

Goals, so that every GPU idle window shows with what the serving process ran in it: the
target loses at most 1 % of its throughput and the agent uses at most 1 % of a core more.

    python3 benchmarks/bench_stacks.py [--phase 20] [--rounds 2] [--clients 4] [--out FILE]

A measurement, not a test: it prints a Markdown table and exits 0 whether or not the goals
are met (1 when it cannot measure: a server that does not start).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from support import free_port, host, report, wait_http

from mrc_agent.reference_service.loadgen import make_photo

REPO = Path(__file__).resolve().parent.parent


QUESTION = itertools.count(1)
GOAL_THROUGHPUT = 0.01
GOAL_CORE = 0.01


def cpu_s(pid: int) -> float:
    """User + system seconds of ``pid`` and of the children it has now (austin)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


async def clients(url: str, n: int, seconds: float) -> int:
    photo = make_photo(640, 480, 1)
    done = 0
    end = time.monotonic() + seconds

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < end:
            # A new question each time, over the whole run: no answer comes from the cache.
            r = await client.post(url + "/mrc/upload",
                                  files={"file": ("p.jpg", photo, "image/jpeg")},
                                  data={"text_prompt": f"What is damaged on parcel "
                                                       f"{next(QUESTION)}?",
                                        "max_new_tokens": "4"})
            if r.status_code == 200 and time.monotonic() < end:
                done += 1

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(one(client) for _ in range(n)))
    return done


def phase(svc: str, svc_pid: int, env: dict[str, str], stacks: bool, seconds: float,
          n: int) -> tuple[float, float]:
    port = free_port()
    extra = ["--collector", "stacks"] if stacks else []
    agent = subprocess.Popen(
        [sys.executable, "-m", "mrc_agent.agent", "run", "--listen", f"127.0.0.1:{port}",
         "--gpu-backend", "none", "--pid", str(svc_pid), "--interval", "0.5", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", "the agent", 60, agent)
        time.sleep(2)  # austin attached and streaming
        c0, t0 = cpu_s(agent.pid), time.monotonic()
        done = asyncio.run(clients(svc, n, seconds))
        wall = time.monotonic() - t0
        return done / wall, (cpu_s(agent.pid) - c0) / wall
    finally:
        agent.terminate()
        agent.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", type=float, default=20.0, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=2, help="A/B/B/A rounds")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cache = os.environ.get("MRC_CACHE_DIR") or tempfile.mkdtemp(prefix="mrc-bench-cache-")
    port = free_port()
    svc = f"http://127.0.0.1:{port}"
    service = subprocess.Popen(
        [sys.executable, "-m", "mrc_agent.reference_service", "--host", "127.0.0.1", "--port",
         str(port), "--cache-dir", cache, "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=env)
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    try:
        wait_http(svc + "/ready", "the service", 600, service)
        asyncio.run(clients(svc, args.clients, 5))  # warm
        for _ in range(args.rounds):
            for stacks in (False, True, True, False):
                results[stacks].append(phase(svc, service.pid, env, stacks, args.phase,
                                             args.clients))
    finally:
        service.terminate()
        service.wait(30)
    rows = ["| phase | agent | answers/s | agent CPU (% of a core) |",
            "| ---: | --- | ---: | ---: |"]
    order = [s for _ in range(args.rounds) for s in (False, True, True, False)]
    seen = {False: 0, True: 0}
    for i, stacks in enumerate(order, 1):
        tput, cpu = results[stacks][seen[stacks]]
        seen[stacks] += 1
        rows.append(f"| {i} | {'with stacks' if stacks else 'without'} | {tput:.2f} | "
                    f"{cpu * 100:.2f} |")
    base_t = statistics.mean(t for t, _ in results[False])
    with_t = statistics.mean(t for t, _ in results[True])
    base_c = statistics.mean(c for _, c in results[False])
    with_c = statistics.mean(c for _, c in results[True])
    loss = 1 - with_t / base_t
    more = with_c - base_c
    # The standard error of the difference of the two means, as a share of the baseline: a
    # loss smaller than this is not resolved by the run.
    noise = (statistics.pvariance([t for t, _ in results[False]]) / len(results[False])
             + statistics.pvariance([t for t, _ in results[True]]) / len(results[True])
             ) ** 0.5 / base_t
    verdict = ("NOT met" if loss > GOAL_THROUGHPUT else
               "met" if noise <= GOAL_THROUGHPUT else
               f"not resolved: the run's noise, {noise * 100:.2f} %, is above the goal")
    text = "\n".join([
        "# Continuous stack sampling: cost to the target and to the agent", "",
        f"Generated by `python3 benchmarks/bench_stacks.py --phase {args.phase:g} --rounds "
        f"{args.rounds} --clients {args.clients}`: the reference service under "
        f"{args.clients} closed-loop clients, watched by `mrc-agent run --interval 0.5` "
        "without and with `--collector stacks` (austin at 10 Hz), phases in A/B/B/A order.",
        "", *rows, "",
        f"- target throughput: {base_t:.2f} answers/s without, {with_t:.2f} with: "
        f"{loss * 100:+.2f} % lost, standard error {noise * 100:.2f} % (goal <= "
        f"{GOAL_THROUGHPUT:.0%}: {verdict})",
        f"- agent CPU: {base_c * 100:.2f} % of a core without, {with_c * 100:.2f} % with: "
        f"{more * 100:+.2f} points (goal <= {GOAL_CORE * 100:g}: "
        f"{'met' if more <= GOAL_CORE else 'NOT met'})",
        "", f"{host()}. The clients, the service and the agent share the cores.",
    ])
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
