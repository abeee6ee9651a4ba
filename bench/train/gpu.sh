#!/usr/bin/env bash
# Tier-2 GPU throughput on one GPU: tokens/s and MFU of gpt2-124m and gpt2-350m in bf16,
# about 5 minutes (compilation included). Needs only torch with CUDA, numpy and pyarrow:
# no Ray, no dataset, no network. Extra arguments go to `python -m bench.train.gpu`.
#
#   bench/train/gpu.sh                    # both presets
#   bench/train/gpu.sh --presets gpt2-124m --seconds 30
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu.sh: $PY has no torch that sees a CUDA device (set PYTHON=... to another interpreter)" >&2
  exit 2
fi
if ! "$PY" -c 'import numpy, pyarrow' 2>/dev/null; then
  echo "gpu.sh: installing numpy and pyarrow for $PY" >&2
  "$PY" -m pip install -q numpy pyarrow
fi
"$PY" -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")'
exec "$PY" -m bench.train.gpu "$@"
