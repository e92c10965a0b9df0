"""Fused Triton kernels, installed as ``tpzoo.kernels`` (sources in the top-level ``kernels/``).

scaled_masked_softmax, scaled_causal_softmax, layer_norm, rms_norm, gelu, bias_gelu, cross_entropy: see
``ops`` for each op and docs/kernels.md for the backends and the math.
"""

# This folder is also findable as a top-level ``kernels`` package when a script runs from the
# repository root, and transformers imports any top-level ``kernels`` it finds (the Hugging Face
# hub-kernels package of that name). Under any name but ``tpzoo.kernels`` this module therefore
# defines and imports nothing: that import stays harmless and transformers finds no version.
if __name__ == "tpzoo.kernels":
    from .ops import (bias_gelu, cross_entropy, gelu, layer_norm, rms_norm, scaled_causal_softmax,
                      scaled_masked_softmax)

    __all__ = ["bias_gelu", "cross_entropy", "gelu", "layer_norm", "rms_norm", "scaled_causal_softmax",
               "scaled_masked_softmax"]
