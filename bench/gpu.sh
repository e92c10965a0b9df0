#!/usr/bin/env bash
# The GPU checks in one command (bench/gpu.py says what runs and how it is time-boxed). On the GPU machine,
# from the repository root, one device call each (at most 9 minutes each; --dry-run: anywhere):
#   bash bench/gpu.sh --parts checks --out "$OUT"      bash bench/gpu.sh --parts models --out "$OUT"
# Python: $PYTHON, else python3. Wheels carried in .whl/ (packages that machine lacks) are installed first,
# and tpzoo in place (pip -e, no network) where it does not import yet.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --target /tmp/tpzoo-site .whl/*.whl
    export PYTHONPATH=/tmp/tpzoo-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -c "import tpzoo.kernels" 2>/dev/null || "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .
exec "$py" bench/gpu.py "$@"
