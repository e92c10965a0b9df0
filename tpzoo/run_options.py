"""The choices of a ``tpzoo.parallel.ParallelPlan``'s run options, importable without torch: the
training scripts offer them as flags and check those before torch loads (``tpzoo.parallel``
itself imports torch)."""

KERNEL_BACKENDS = ("auto", "triton", "torch")
ATTENTION_BACKENDS = ("auto", "fused-softmax", "sdpa")
# the plan's fields besides the mesh: what older checkpoints kept in the model config
PLAN_OPTIONS = ("sequence_parallel", "recompute_activations", "kernels", "attention_backend", "seed", "compile",
                "fsdp")
