"""Hugging Face <-> tpzoo checkpoints (see docs/conversion.md and ``python -m tpzoo.convert --help``)."""

from tpzoo.convert.hf import from_hf, hf_to_tpzoo, read_hf, to_hf, tpzoo_to_hf, write_hf
from tpzoo.convert.mapping import ConversionError, architectures

__all__ = ["ConversionError", "architectures", "from_hf", "hf_to_tpzoo", "read_hf", "to_hf", "tpzoo_to_hf",
           "write_hf"]
