#!/usr/bin/env bash
# The one prepared GPU check for a device machine (one H200), as one command:
#   run(command="bash benchmarks/h200_check.sh", carry=[".whl"], timeout_s=420)
# after `bash benchmarks/h200_prepare.sh` here. Writes under $OUT (or ./h200-out): doctor's
# table, the self-check's table, JSON and 20 s trace, and the log. About 2 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-h200-out}
mkdir -p "$out"
exec > >(tee "$out/h200_check.log") 2>&1
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site
fi
# The project from the checkout, without installing it: the namespace links.
export PYTHONPATH=$PWD/.ci/namespace${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv || true
python3 -c "import torch, pynvml; print('torch', torch.__version__, torch.cuda.is_available()); print('nvidia-ml-py', pynvml.__file__)"
echo "== doctor"
timeout 60 python3 -m mrc_agent.agent doctor --gpu-backend nvml --collector profiling \
    | tee "$out/doctor.txt"
echo "== selfcheck"
timeout 300 python3 benchmarks/gpu_truth.py --out "$out/gpu-truth"
rc=$?
echo "selfcheck rc=$rc"
exit $rc
