"""The agent's GPU readings against an independent reference on real hardware: the same code
as ``mrc-agent selfcheck``, runnable from a checkout without installing the package.

Pinned host<->device copies, device-to-device copies and bf16 GEMMs of known size, timed with
CUDA events, against the agent's PCIe counters and rates, GPM, CUPTI PM sampling, NVML
utilisation and its sample timestamps (and NVLink with two linked GPUs), PCIe counters at
the agent's cadences and over one long gap, and the CUPTI sampler in a CUDA-free process of
its own; then a 20 s trace under a mixed workload for ``tests/data/``. About 2 minutes on one
H200 (docs/selfcheck.md); on Hopper+ a metric the agent reports nothing for is a FAIL.

    python3 benchmarks/gpu_truth.py [--out DIR] [--duration SECONDS]   # the GPU check
    python3 benchmarks/gpu_truth.py --dry [--out DIR]                  # simulated, anywhere

Unlike the other benchmarks this one is a check: exit 0 when no metric failed, 1 when one did,
2 for bad flags or no CUDA GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mrc_agent.agent.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    """``mrc-agent selfcheck`` with ``--gpu`` unless ``--dry`` (or ``--gpu``) is given."""
    if not {"--dry", "--gpu", "-h", "--help"} & set(argv):
        argv = ["--gpu", *argv]
    return cli_main(["selfcheck", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
