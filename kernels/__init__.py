"""Fused Triton kernels, installed as ``tpzoo.kernels`` (sources in the top-level ``kernels/``)."""
