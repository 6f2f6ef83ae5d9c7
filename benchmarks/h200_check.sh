#!/usr/bin/env bash
# The one prepared GPU check for a device machine (one H200), as one command:
#   run(command="bash benchmarks/h200_check.sh", carry=[".whl"], timeout_s=420)
# after `bash benchmarks/h200_prepare.sh` here. Installs the carried wheels into a virtual
# environment, proves which libcupti cupti-python loads, then writes under $OUT (or
# ./h200-out): doctor's table, the self-check's table, JSON and 20 s trace, the sampler
# process's log and this log, and prints a short summary. About 3 minutes.
# Exit: the self-check's status (0 pass, 1 a check failed, 2 no GPU); 3 when the wheels or
# the libcupti they should provide are not what h200_prepare.sh pinned.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-h200-out}
mkdir -p "$out"
exec > >(tee "$out/h200_check.log") 2>&1
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
# Every distribution installed from .whl, each pinned in h200_prepare.sh's PINS.
REQUIRED=(cupti-python nvidia-cuda-cupti cuda-bindings cuda-pathfinder nvidia-ml-py pyelftools
          bcrypt mrc-agent)
for name in "${REQUIRED[@]}"; do
    stem=${name//-/_}
    ls .whl/"$stem"-*.whl >/dev/null 2>&1 || { echo "missing wheel for $name in .whl/"; exit 3; }
done
venv=/tmp/mrc-h200-venv
rm -rf "$venv"
# torch and numpy come from the machine; everything in .whl from the venv's own site-packages.
python3 -m venv --system-site-packages "$venv" || exit 3
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --no-cache-dir .whl/*.whl || exit 3
py=$venv/bin/python
echo "== libcupti"
"$py" - "$out/libcupti.json" <<'PY' || exit 3
import json, os, sys
from importlib import metadata
from cuda.pathfinder import load_nvidia_dynamic_lib

pins = dict(line.strip().split("==") for line in open(".whl/PINS") if "==" in line)
lib = load_nvidia_dynamic_lib("cupti")
dist = metadata.distribution("nvidia-cuda-cupti")
files = {os.path.realpath(dist.locate_file(f)) for f in dist.files or ()}
found = {"path": lib.abs_path, "in_wheel": os.path.realpath(lib.abs_path) in files,
         "nvidia-cuda-cupti": dist.version, "pinned": pins.get("nvidia-cuda-cupti"),
         "cupti-python": metadata.version("cupti-python"), "python": sys.executable}
json.dump(found, open(sys.argv[1], "w"), indent=1)
print(found)
wrong = {n: metadata.version(n) for n in pins if metadata.version(n) != pins[n]}
if wrong or not found["in_wheel"]:
    sys.exit(f"not the pinned CUPTI: versions {wrong}, libcupti in the wheel: {found['in_wheel']}")
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv || true
"$py" -c "import torch, pynvml; print('torch', torch.__version__, torch.cuda.is_available()); print('nvidia-ml-py', pynvml.__file__)"
echo "== doctor"
timeout 60 "$py" -m mrc_agent.agent doctor --gpu-backend nvml --collector profiling \
    | tee "$out/doctor.txt"
echo "== selfcheck"
timeout 240 "$py" benchmarks/gpu_truth.py --out "$out/gpu-truth"
rc=$?
echo "== summary (selfcheck rc=$rc)"
"$py" - "$out/gpu-truth/gpu_truth.json" "$out/libcupti.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
dev = r.get("device", {})
print("part", dev.get("part"), "counts", r.get("counts"), "elapsed", r.get("elapsed_s"), "s")
proc = dev.get("cupti_process", {})
print("sampler process: started", proc.get("started"), "torch", proc.get("torch_imported"),
      "memory before", proc.get("memory_before"), "after", proc.get("memory_started"),
      "libcupti", (proc.get("libcupti") or {}).get("mapped"))
print("libcupti check:", json.load(open(sys.argv[2])))
for c in r.get("checks", []):
    if c["verdict"] != "PASS":
        print(f"{c['verdict']} {c['name']}: {c['note'][:200]}")
PY
exit $rc
