#!/usr/bin/env bash
# The prepared GPU check on one GPU (about 7 minutes, at most 9, compilation included): the
# environment, tokens/s and MFU of gpt2-124m and gpt2-350m through the real training step at two
# micro-batches, the loss's share of a step, an FSDP2 bf16 gpt2-774m step with a checkpoint saved
# and loaded, a 5-step profile, infer's scoring and decoding tokens/s, and last the lowest MFU over its
# target (docs/gpu.md).
# Needs only torch with CUDA, numpy and pyarrow: no Ray, no dataset, no network, no pip. Extra
# arguments go to `python -m bench.train.gpu`.
#
#   bench/train/gpu.sh                    # the whole check
#   bench/train/gpu.sh --presets gpt2-124m --seconds 30
#   bench/train/gpu.sh --smoke            # every part on the CPU with the debug preset, in seconds
set -euo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then
  SMOKE=1
  shift
  set -- --device cpu --presets debug --fsdp-preset debug --seconds 0.5 --warmup 1 --no-compile "$@"
fi
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# No network and no pip on the GPU machine: say at once what is missing instead of installing it.
if ! SMOKE=$SMOKE "$PY" - <<'EOF'
import importlib.util, os, sys
missing = [m for m in ("torch", "numpy", "pyarrow") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu.sh: {sys.executable} lacks {', '.join(missing)} (set PYTHON=... to an interpreter that has them)")
import torch
if os.environ["SMOKE"] == "0" and not torch.cuda.is_available():
    sys.exit(f"gpu.sh: torch {torch.__version__} in {sys.executable} sees no CUDA device")
EOF
then
  exit 2
fi
exec "$PY" -m bench.train.gpu "$@"
