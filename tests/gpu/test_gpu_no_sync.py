"""No host-device synchronisation inside forward and backward of any family on the device
(no_sync.py: torch.cuda.set_sync_debug_mode("error") around a training step of each case; the mixtures of experts
with their experts as one grouped multiply)."""

from __future__ import annotations

import json

from families import CASES
from gpu_helpers import DEVICE, GPU_DIR, run
from no_sync import SYNCS


def test_forward_and_backward_never_sync(work):
    done = run([str(GPU_DIR / "no_sync.py")], work)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"].startswith(DEVICE), result
    assert result["checked"] == [f"{name}-{attention}" for name in CASES if name not in SYNCS
                                 for attention in ("sdpa", "fused-softmax")]
