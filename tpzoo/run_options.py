"""The choices of a ``tpzoo.parallel.ParallelPlan``'s run options, importable without torch: the
training scripts offer them as flags and check those before torch loads (``tpzoo.parallel``
itself imports torch)."""

KERNEL_BACKENDS = ("auto", "triton", "torch")
ATTENTION_BACKENDS = ("auto", "fused-softmax", "sdpa")
# context parallelism's attention (Megatron-LM's --cp-comm-type): ring attention, or DeepSpeed-Ulysses' all-to-all
CP_COMM_TYPES = ("p2p", "a2a")
# the plan's fields besides the mesh: what older checkpoints kept in the model config
PLAN_OPTIONS = ("sequence_parallel", "recompute_activations", "kernels", "attention_backend", "seed", "compile",
                "fsdp", "recompute_granularity", "recompute_method", "recompute_num_layers")
# Megatron-LM's activation recompute (--recompute-granularity, --recompute-method)
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
# Megatron-LM's --attention-backend values -> tpzoo's: its fused-kernel attentions (flash: FlashAttention, fused:
# cuDNN's) = torch's sdpa (flash, memory-efficient or cuDNN kernels, whichever applies); its unfused and local ones
# = the explicit softmax(q k^T) v of fused-softmax
MEGATRON_ATTENTION_BACKENDS = {"flash": "sdpa", "fused": "sdpa", "unfused": "fused-softmax", "local": "fused-softmax"}


def resolve_attention_backend(backend: str) -> str:
    """"fused-softmax" or "sdpa" for ``--attention-backend``. auto: sdpa on every device. Its fused kernels
    (flash or memory-efficient attention on CUDA, a flash kernel on the CPU) never materialize the [b, n, s, s]
    scores that the fused softmax needs, and measured faster on the CPU too (docs/models.md)."""
    if backend in ("fused-softmax", "sdpa"):
        return backend
    if backend != "auto":
        raise ValueError(f"attention backend must be auto, fused-softmax or sdpa, got {backend!r}")
    return "sdpa"


def recompute_problem(recompute_activations: bool, granularity: str | None, method: str | None,
                      num_layers: int | None) -> str | None:
    """What is wrong with these recompute options (Megatron-LM's rules: full needs a method and a layer
    count, selective neither; tpzoo's --recompute-activations not besides them), or None."""
    if granularity not in (None, *RECOMPUTE_GRANULARITIES) or method not in (None, *RECOMPUTE_METHODS):
        return (f"--recompute-granularity must be one of {', '.join(RECOMPUTE_GRANULARITIES)} and --recompute-method "
                f"one of {', '.join(RECOMPUTE_METHODS)}; got {granularity!r}, {method!r}")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        return f"--recompute-num-layers must be an int >= 1, got {num_layers!r}"
    if granularity is not None and recompute_activations:
        return (f"--recompute-activations (tpzoo's: every layer recomputed, = --recompute-granularity full "
                f"--recompute-method uniform --recompute-num-layers 1) and --recompute-granularity {granularity} "
                f"both given; keep one")
    if granularity == "full" and (method is None or num_layers is None):
        return (f"--recompute-granularity full needs --recompute-method (uniform or block) and "
                f"--recompute-num-layers; got {method}, {num_layers}")
    if granularity != "full" and (method is not None or num_layers is not None):
        given = (("method", method), ("num-layers", num_layers))
        flags = " ".join(f"--recompute-{name} {value}" for name, value in given if value is not None)
        return (f"{flags}: for --recompute-granularity full only (selective recomputes the core attention of every "
                f"layer); drop it or add --recompute-granularity full")
    return None


def context_cut_problem(seq_length: int, cp: int, balanced: bool, tp_split: int = 1) -> str | None:
    """What keeps sequences of ``seq_length`` tokens from being cut over ``cp`` context-parallel ranks (2 cp chunks when
    ``balanced``, a causal model's load-balanced cut; ``tpzoo.engine.context_cut``), each rank's piece then over
    ``tp_split`` ranks of sequence parallelism; or None."""
    chunks = 2 * cp if balanced else cp
    if seq_length % chunks:
        why = f"2 x cp = {chunks} (a causal model's load-balanced cut)" if balanced else f"cp = {cp}"
        return f"sequence length {seq_length} is not divisible by {why}; choose a multiple of {chunks}"
    if (seq_length // cp) % tp_split:
        return (f"each cp rank's {seq_length // cp} tokens (sequence length {seq_length} / cp {cp}) are not divisible "
                f"by tp = {tp_split} for sequence parallelism; choose a sequence length that is a multiple of "
                f"{chunks * tp_split}")
    return None


def local_sgd_problem(steps: int | None, fsdp: bool, ep: int, cp: int, zero: bool = False) -> str | None:
    """What keeps local SGD (--local-sgd-steps ``steps``; ``tpzoo.engine.local_sgd``) from running on a mesh with
    these settings, or None: each dp replica must hold all its weights and take its own steps."""
    for on, why in ((fsdp, "FSDP shards each replica's weights over dp; drop --use-torch-fsdp2"),
                    (zero, "the distributed optimizer shards each replica's optimizer state over dp; drop "
                           "--use-distributed-optimizer"),
                    (ep > 1, f"experts split over ep {ep} ranks of dp are parts of one replica; drop "
                             f"--expert-model-parallel-size"),
                    (cp > 1, f"the cp {cp} ranks of a sequence are parts of one replica; drop "
                             f"--context-parallel-size")):
        if steps is not None and on:
            return f"--local-sgd-steps {steps}: {why} or --local-sgd-steps"
    return None
