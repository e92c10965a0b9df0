"""tpzoo: Megatron-style tensor, pipeline and data parallel transformers."""

__version__ = "0.1.0"
