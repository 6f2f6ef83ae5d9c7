"""Memory of decoding a large transparent image: peak and retained RSS of the preprocessing path.

A 7000x7000 RGBA PNG compresses to a few hundred KB yet decodes to 196 MB of pixels; the
colour conversion to RGB used to hold three RGBA copies at once. Each measurement runs in a
fresh process (so one run's heap does not flatter the next): one decode, then six at once on
six threads (the decode pool's worst case with ``preprocess_workers=6``), reporting the peak
RSS over the start and the RSS left one second after, with Python's garbage collected.

Run side by side with a baseline checkout (``--baseline REPO``, e.g. a ``git worktree`` of an
earlier commit); the report gives ratios against it.

    python benchmarks/bench_image_memory.py [--baseline /tmp/old] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from support import report

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import gc, io, json, resource, sys, threading, time
import numpy as np
from PIL import Image
from mrc_agent.reference_service.preprocess import preprocess
from mrc_agent.reference_service.settings import Settings

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
side, parallel = int(sys.argv[1]), int(sys.argv[2])
y = np.linspace(0, 255, side, dtype=np.uint8)
alpha = np.broadcast_to(y[:, None], (side, side))
rgba = np.dstack([np.full((side, side), 200, np.uint8), np.zeros((side, side), np.uint8),
                  np.full((side, side), 90, np.uint8), alpha])
buf = io.BytesIO()
Image.fromarray(rgba, "RGBA").save(buf, "PNG", optimize=True)
data = buf.getvalue()
del rgba, alpha, buf
gc.collect()
settings = Settings()
if sys.argv[3] == "1":
    try:
        from mrc_agent.reference_service.main import return_large_frees_to_the_os
        return_large_frees_to_the_os()  # what the service does at start
    except ImportError:
        pass  # a baseline from before it existed
def one():
    preprocess(data, (336, 336), [0.5] * 3, [0.5] * 3, "cpu", 1024, settings,
               resize_backend="pil")
one()  # warm: imports, torch's allocator, Pillow's plugins
gc.collect()
time.sleep(0.2)
start = rss()
base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
threads = [threading.Thread(target=one) for _ in range(parallel)]
for t in threads:
    t.start()
for t in threads:
    t.join()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
gc.collect()
time.sleep(1.0)
print(json.dumps({"png_bytes": len(data), "start": start, "peak": max(peak, base_peak),
                  "after": rss(), "warm_peak": base_peak}))
"""


def measure(repo: Path, side: int, parallel: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(side), str(parallel), "1"], cwd=repo,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(repo / ".ci" / "namespace"),
                              "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, help="an earlier checkout to compare against")
    p.add_argument("--side", type=int, default=7000)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    mb = 1 / (1 << 20)
    runs = [("this tree", REPO)] + ([("baseline", args.baseline)] if args.baseline else [])
    rows, results = [], {}
    for name, repo in runs:
        for parallel in (1, 6):
            r = measure(repo, args.side, parallel)
            results[(name, parallel)] = r
            rows.append(f"| {name} | {parallel} | {r['png_bytes'] // 1024} KB | "
                        f"{(r['peak'] - r['start']) * mb:.0f} | "
                        f"{(r['after'] - r['start']) * mb:.0f} |")
    lines = [f"# Decoding a {args.side}x{args.side} RGBA PNG: RSS in MB over the warmed start", "",
             "| tree | decodes at once | PNG size | peak over start | left after 1 s |",
             "| --- | --- | --- | --- | --- |", *rows]
    if args.baseline:
        lines.append("")
        for parallel in (1, 6):
            new, old = results[("this tree", parallel)], results[("baseline", parallel)]
            ratio = (new["peak"] - new["start"]) / max(1, old["peak"] - old["start"])
            lines.append(f"- {parallel} at once: peak {ratio:.2f}x "
                         f"the baseline's; retained {(new['after'] - new['start']) * mb:.0f} MB "
                         f"vs {(old['after'] - old['start']) * mb:.0f} MB")
    text = "\n".join(lines)
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
