"""pretrain.py on the device: GPT and BERT learn under --bf16 and --fp16, log MFU where the GPU's peak
is known, run Triton kernels compiled for the GPU, and a run resumed from its checkpoint continues it.

The four runs (gpu_helpers.PRETRAIN_RUNS: 40 iterations of 2-layer, hidden-64 models, checkpoints at 20
and 40) are made once per session; the fine-tuning, generation and conversion tests start from them.
"""

from __future__ import annotations

import math

import pytest
from families import CAUSAL_LM, MASKED_LM
from gpu_helpers import DEVICE, PRETRAIN, PRETRAIN_RUNS, compiled_kernels, run
from pretrain_helpers import metrics, rel

from tpzoo.training.metrics import PEAK_FLOPS

RUNS = pytest.mark.parametrize("model, precision", PRETRAIN_RUNS, ids=[f"{m}-{p}" for m, p in PRETRAIN_RUNS])
RESUMED = [(CAUSAL_LM.family, "bf16"), (MASKED_LM.family, "fp16")]  # the runs resumed from their checkpoint
# mean of the last 5 losses below the mean of the first 5, in nats (CPU, same flags: gpt 1.4, bert 0.55)
LOSS_DROP = 0.25
# a resumed run vs the uninterrupted one, loss by loss: on the CPU they are equal; on a GPU
# nondeterministic kernels (sdpa's backward) differ in the last bits, which bf16/fp16 steps amplify
RESUME_RTOL = 2e-2
# the Triton kernels each attention backend's models run (one .cubin or more each)
KERNELS = {"auto": {"_norm_fwd", "_norm_bwd", "_gelu_kernel"}}
KERNELS["fused-softmax"] = KERNELS["auto"] | {"_softmax_fwd", "_softmax_bwd"}


@RUNS
def test_pretrain_loss_falls_and_checkpoints_are_written(pretrained, model, precision):
    save = pretrained(model, precision)
    log = metrics(save)
    assert sorted(log) == list(range(1, 41))
    losses = [log[i]["loss"] for i in sorted(log)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"{model} {precision}: mean loss of iterations 1-5 {first:.4f}, of 36-40 {last:.4f}")
    assert all(math.isfinite(x) for x in losses), losses
    assert last < first - LOSS_DROP, losses
    assert [i for i in sorted(log) if "val_loss" in log[i]] == [20, 40]
    assert all(math.isfinite(log[i]["val_loss"]) for i in (20, 40))
    assert (save / "latest").read_text().strip() == "iter_0000040" and (save / "iter_0000020").is_dir()


@RUNS
def test_pretrain_logs_mfu_on_a_gpu_of_known_peak(pretrained, device_name, model, precision):
    peaks = next((p for fragment, p in PEAK_FLOPS if fragment in device_name), {})
    if precision not in peaks:
        assert not any(gpu in device_name for gpu in ("H100", "H200")), f"PEAK_FLOPS lacks {device_name} {precision}"
        pytest.skip(f"no peak FLOP/s known for {device_name} at {precision}: no MFU to log")
    mfu = [r.get("mfu") for r in metrics(pretrained(model, precision)).values()]
    print(f"{model} {precision} on {device_name}: MFU {min(mfu):.2e} .. {max(mfu):.2e}")
    assert all(m is not None and 0 < m < 1 for m in mfu), mfu


@pytest.mark.skipif(DEVICE == "cpu", reason="on the CPU the models run the torch kernels (--kernels auto)")
@RUNS
def test_pretrain_runs_triton_kernels_compiled_for_the_gpu(pretrained, model, precision):
    pretrained(model, precision)
    compiled = compiled_kernels(pretrained.triton_cache(model, precision))
    expected = KERNELS[PRETRAIN_RUNS[model, precision]]
    assert expected <= compiled, f"not compiled: {sorted(expected - compiled)}; compiled: {sorted(compiled)}"


@pytest.mark.parametrize("model, precision", RESUMED, ids=[f"{m}-{p}" for m, p in RESUMED])
def test_resume_from_a_checkpoint_continues_the_run(pretrained, work, model, precision):
    """--load <run>/iter_0000020 with the run's flags logs iterations 21-40 as the whole run did
    (restored weights, AdamW state, fp16 loss scale, RNG and data position)."""
    whole = pretrained(model, precision)
    resumed = work / f"{model}-{precision}-resumed"
    run([PRETRAIN, *pretrained.flags(model, precision), "--load", str(whole / "iter_0000020"), "--save", resumed.name],
        work)
    before, after = metrics(whole), metrics(resumed)
    assert sorted(after) == list(range(21, 41))
    worst = max(rel(after[i][key], before[i][key]) for i in after for key in ("loss", "val_loss") if key in before[i])
    print(f"{model} {precision} resumed at 20: largest relative loss difference {worst:.2e}")
    assert worst <= RESUME_RTOL
