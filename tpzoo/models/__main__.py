"""python -m tpzoo.models: the presets, their shapes and parameter counts."""

from tpzoo.models.presets import format_presets

if __name__ == "__main__":
    print(format_presets())
