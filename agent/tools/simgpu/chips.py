"""What a simulated chip offers for PM sampling: CUPTI's metric names and the single-pass set
the wheel ships for the dry run's GH100.

:data:`GH100_SETS_FILE` (``agent/tools/data/gh100_pm_sampling.json``) holds GH100's one
single-pass set, ``Compute_Triage``, as ``libcupti.so.13`` 13.4.92 ships it: the set's metric
list and the names of its user metrics, written from
``tests/data/cupti_sets/cupti-13.4.92.json`` by
``python3 -m mrc_agent.agent.tools.simgpu.chips SOURCE.json`` (a test checks it still equals
that file's GH100 entry). ``cupti.shipped_device`` is the fake device offering it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GH100_SETS_FILE = Path(__file__).resolve().parents[1] / "data" / "gh100_pm_sampling.json"
CHIP = "gh100"
#: The rollups a chip accepts by full name without a set: a counter's sum, a throughput's
#: percentage of its peak.
COUNTER_ROLLUP, THROUGHPUT_ROLLUP = ".sum", ".avg.pct_of_peak_sustained_elapsed"


def base_name(metric: str) -> str:
    """The name less its rollup, prefix kept: ``Compute_Triage.dramc__read_throughput.avg...``
    -> ``Compute_Triage.dramc__read_throughput``; ``dram__bytes_read.sum`` ->
    ``dram__bytes_read`` (CUPTI names: ``[<UNIT>.][<set>.]<unit>__<counter>[.<rollup>]``)."""
    parts = metric.strip().split(".")
    at = next((i for i, part in enumerate(parts) if "__" in part), 0)
    return ".".join(parts[:at + 1])


def unit_of_name(metric: str) -> str:
    """The dimensional unit a metric's name implies, as ``get_metric_properties`` states it."""
    root = base_name(metric)
    for word, unit in (("throughput", "%"), ("sectors", "sectors"), ("bytes", "bytes"),
                       ("inst", "inst")):
        if word in root:
            return unit
    return ""


def load_sets(path: Path = GH100_SETS_FILE) -> dict[str, Any]:
    """The shipped GH100 set: ``{"cupti", "chip", "set", "metrics", "user_metrics"}``."""
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def extract(source: dict[str, Any], chip: str = CHIP) -> dict[str, Any]:
    """The shipped file's content from one ``tests/data/cupti_sets`` file."""
    entries = [s for s in source["sets"] if chip in s["chips"]]
    if len(entries) != 1:
        raise ValueError(f"{chip}: expected one set, found {len(entries)}")
    entry = entries[0]
    return {"cupti": source["cupti"], "chip": chip, "set": entry["set"],
            "metrics": list(entry["metrics"]), "user_metrics": sorted(entry["user_metrics"])}


def main(argv: list[str]) -> int:
    """Rewrite :data:`GH100_SETS_FILE` from a ``tests/data/cupti_sets`` file."""
    if len(argv) != 1:
        print("usage: python3 -m mrc_agent.agent.tools.simgpu.chips "
              "tests/data/cupti_sets/cupti-13.4.92.json", file=sys.stderr)
        return 2
    data = extract(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    GH100_SETS_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{GH100_SETS_FILE}: {len(data['metrics'])} metrics, "
          f"{len(data['user_metrics'])} user metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
