#!/usr/bin/env bash
# GPU check (issue 18, item 6), on one CUDA device, in under 8 minutes:
#   1. the conformance zoo on CUDA (tests/test_conformance_zoo.py and
#      tests/test_conformance_torch_func.py, the [cuda-*] cases): every row
#      against plain hooks on a deep copy; unsampled steps under
#      torch.cuda.set_sync_debug_mode("error"), host syncs counted on sampled steps
#      (test_cuda_host_syncs);
#   2. bench/sampled.py --device cuda: a sampled step against hand-rolled hooks and plain.
# Output goes to stdout and, when $OUT is set, to $OUT/device_check.log.
#
# Where uv and the project's environment exist, everything runs through `uv run`. Elsewhere (a
# machine with a CUDA torch already installed and no package index, say) it runs `python3` with
# src/, tests/ and bench/ on PYTHONPATH; packages that python3 lacks (polars, for one) can be
# brought as wheels in .whl/ (installed into /tmp/site first), fetched beforehand where an index
# is reachable, for that machine's Python (3.12 here), e.g.:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     polars==2.1.0 polars-runtime-32==2.1.0
# python3's torch there must be at least the project's floor (pyproject); print it first.
# Usage: bash bench/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

export CUBLAS_WORKSPACE_CONFIG=:4096:8   # deterministic cuBLAS: the zoo compares two runs
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
LOG=${OUT:+$OUT/device_check.log}
LOG=${LOG:-/dev/null}

if command -v uv >/dev/null 2>&1 && [ -f uv.lock ]; then
  PY=(uv run python)
else
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
  PY=(python3)
fi
exec > >(tee "$LOG") 2>&1

nvidia-smi -L || true
"${PY[@]}" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1

status=0
echo "== conformance zoo and host syncs on CUDA"
timeout 330 "${PY[@]}" -m pytest -q -p no:cacheprovider -rA --durations=15 \
  tests/test_conformance_zoo.py tests/test_conformance_torch_func.py -k cuda || status=1

echo "== bench/sampled.py on CUDA"
timeout 120 "${PY[@]}" bench/sampled.py --device cuda --rounds 5 || status=1
exit $status
