"""Copy the generated PrometheusRule and dashboards ConfigMap into the kustomize base.

Kustomize will not load files outside a kustomization's directory, so ``deploy/base`` holds
byte-for-byte copies of ``alerts/generated/mrc-prometheusrule.yaml`` and
``dashboards/generated/mrc-dashboards-configmap.yaml``. Rebuild those first, then run this::

    mrc-agent alerts build && mrc-agent dashboards build && python3 deploy/sync_generated.py

``--check`` copies nothing and exits 1 when a copy differs from its source (for CI);
``tests/integration/test_deploy.py`` checks the same.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "deploy" / "base"

#: Copy in deploy/base -> its source, relative to the repository.
COPIES: dict[str, str] = {
    "mrc-prometheusrule.yaml": "alerts/generated/mrc-prometheusrule.yaml",
    "mrc-dashboards-configmap.yaml": "dashboards/generated/mrc-dashboards-configmap.yaml",
}


def stale() -> list[str]:
    """Copies in deploy/base that differ from (or lack) their generated source."""
    return [name for name, src in COPIES.items()
            if not (BASE / name).is_file()
            or (BASE / name).read_bytes() != (REPO / src).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="copy nothing; exit 1 when a copy is stale")
    args = parser.parse_args(argv)
    if args.check:
        for name in stale():
            print(f"deploy/base/{name} differs from {COPIES[name]}: run "
                  "python3 deploy/sync_generated.py", file=sys.stderr)
        return 1 if stale() else 0
    for name, src in COPIES.items():
        shutil.copyfile(REPO / src, BASE / name)
        print(BASE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
