"""Regenerate the CUPTI PM-sampling metric sets kept beside this file from NVIDIA's wheels.

CUPTI ships each chip's PM-sampling configuration inside ``libcupti.so.13`` as YAML documents
(``version: ...`` / ``gpu: [chip, ...]`` / ``metricGroups`` / ``triageGroup``), one per
single-pass set. This script downloads the ``nvidia-cuda-cupti`` wheels named below with pip
(no install), reads those documents out of the library and writes one JSON file per version:

    {"cupti": "13.4.92", "sets": [{"chips": [...], "set": "Compute_Triage",
      "metrics": [...], "user_metrics": {"Compute_Triage.dramc__read_throughput":
      {"kind": "throughput", "counters": ["dramc__sectors_op_read"]}, ...}}, ...]}

``metrics`` is every metric the set's groups list, in the library's order; it is what the test
fake answers for ``cupti.profiler_host.get_metrics_in_single_pass_set`` (the hardware check
records the real answer beside it). Run from the repository root::

    python3 tests/data/cupti_sets/regenerate.py [VERSION ...]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

#: The wheels the tests pin: the CUPTI the profiling extra resolves to today, and the next.
VERSIONS = ("13.4.92", "13.5.25")
HERE = Path(__file__).resolve().parent
_DOC_START = re.compile(rb"version: [0-9.]+\ngpu: \[")


def documents(library: bytes) -> list[dict[str, Any]]:
    """Every PM-sampling set document in a ``libcupti.so`` image, as parsed YAML."""
    out = []
    for match in _DOC_START.finditer(library):
        end = library.index(b"\0", match.start())
        out.append(yaml.safe_load(library[match.start():end].decode("utf-8")))
    return out


def summarise(doc: dict[str, Any]) -> dict[str, Any]:
    """The parts of one set document the metric chooser and its fake need."""
    metrics: list[str] = []
    for group in doc.get("metricGroups") or []:
        for body in group.values():
            metrics.extend(str(m) for m in body.get("metrics") or [])
    user: dict[str, Any] = {}
    for entry in doc.get("userMetrics") or []:
        for name, body in entry.items():
            kind = next((k for k in ("throughput", "ratio", "counter", "sum") if k in body),
                        "other")
            value = body.get(kind)
            counters = value if isinstance(value, list) else []
            user[str(name)] = {"kind": kind, "counters": [str(c) for c in counters]}
    return {"chips": [str(c) for c in doc["gpu"]], "set": str(doc["triageGroup"]["name"]),
            "metrics": metrics, "user_metrics": user}


def library_of(version: str, workdir: Path) -> bytes:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    f"nvidia-cuda-cupti=={version}", "-d", str(workdir)], check=True)
    wheel = next(workdir.glob(f"nvidia_cuda_cupti-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/libcupti.so.13"))
        return zf.read(name)


def main(argv: list[str]) -> int:
    for version in argv or VERSIONS:
        with tempfile.TemporaryDirectory() as tmp:
            library = library_of(version, Path(tmp))
        sets = [summarise(doc) for doc in documents(library)]
        path = HERE / f"cupti-{version}.json"
        path.write_text(json.dumps({"cupti": version, "sets": sets}, indent=1) + "\n")
        print(f"{path}: {len(sets)} sets, chips "
              f"{sorted({c for s in sets for c in s['chips']})}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
