"""Fused Triton kernels, installed as ``tpzoo.kernels`` (sources in the top-level ``kernels/``).

scaled_masked_softmax, scaled_causal_softmax, layer_norm, rms_norm, gelu, bias_gelu, cross_entropy: see
``ops`` for each op and docs/kernels.md for the backends and the math.
"""

# This folder is also findable as a top-level ``kernels`` package when a script runs from the repository
# root, and transformers (5.x requires it) imports Hugging Face's hub-kernels package of that name. Under any
# name but ``tpzoo.kernels`` this module therefore hands the import over to the installed package of that name
# (found on sys.path without the repository root), or fails as if there were none: never shadows it.
if __name__ == "tpzoo.kernels":
    from .ops import (bias_gelu, cross_entropy, gelu, layer_norm, rms_norm, scaled_causal_softmax,
                      scaled_masked_softmax)

    __all__ = ["bias_gelu", "cross_entropy", "gelu", "layer_norm", "rms_norm", "scaled_causal_softmax",
               "scaled_masked_softmax"]
else:
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(__name__, [p for p in _sys.path if _os.path.abspath(p or ".") != _root])
    if _spec is None:
        raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)
    _installed = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _installed  # the import statement returns what sys.modules holds after this runs
    _spec.loader.exec_module(_installed)
