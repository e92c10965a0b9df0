"""Packages whose names load on first use (PEP 562), so that their light modules (configs, flags)
import without torch:

    __getattr__, __all__ = lazy_exports(__name__, {"gpt": ("GPTModel",), "config": ("TransformerConfig",)})
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any], list[str]]:
    """A module ``__getattr__`` that imports ``package.<module>`` for each of its names in ``exports``
    ({module: names}) when first asked, and the ``__all__`` of those names."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{module_of[name]}"), name)

    return __getattr__, sorted(module_of)
