"""A mixture of experts' grouped multiply on the device (moe_grouped.py): the same outputs and gradients as the loop
over experts, within bfloat16's and float32's rounding (different summation orders)."""

from __future__ import annotations

import json

from gpu_helpers import DEVICE, GPU_DIR, run


def test_grouped_gemm_equals_the_loop_over_experts(work):
    done = run([str(GPU_DIR / "moe_grouped.py")], work)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"].startswith(DEVICE), result
    assert result["bfloat16"] < 2e-2 and result["float32"] < 1e-3, result
