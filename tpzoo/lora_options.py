"""What a LoRA fine-tuning adds to a model (Hu et al. 2021), importable without torch: the fine-tuning script
offers these as flags and checks them before torch loads; ``tpzoo.parallel.lora`` applies them.

    W x  ->  W x + (alpha / r) B A dropout(x),   A [r, in], B [out, r]; W frozen, A and B trained

``targets``: module names of the model's transformer layers (the attention's ``query_key_value`` and
``dense``, the MLP's ``dense_h_to_4h`` and ``dense_4h_to_h``); rank 0 means no adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpzoo.fields import at_least, check_fields, fraction, option, positive_number, string, toggle

# the linear layers of the block library's transformer layer (tpzoo.models.attention, tpzoo.models.mlp)
LAYER_LINEARS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


def _targets(v: object) -> str | None:
    problem = string(v)
    if problem:
        return problem
    names = v.split(",")
    unknown = [n for n in names if n not in LAYER_LINEARS]
    if unknown or not v:
        return f"must name linear layers of a transformer layer, comma-separated, among {','.join(LAYER_LINEARS)}; " \
               f"got {v!r}"
    return None


_targets.parse = str


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters of a run: their rank, scale, dropout and the layers they adapt; ``rank`` 0: none."""

    rank: int = option(0, at_least(0), "rank r of each adapter; 0: no adapters, every weight trained", "--lora-rank")
    alpha: float = option(16.0, positive_number, "the adapters' output is scaled by alpha / r", "--lora-alpha")
    dropout: float = option(0.0, fraction, "dropout on the adapters' input", "--lora-dropout")
    targets: str = option("query_key_value,dense", _targets, "the layers adapted, comma-separated module names of "
                          "each transformer layer: query_key_value, dense (attention; the default, as Hu et al. "
                          "adapt), dense_h_to_4h, dense_4h_to_h (MLP)", "--lora-target")
    save_adapters_only: bool = toggle("checkpoints hold the adapters alone and name the --load checkpoint they "
                                      "adapt (which must stay where it is)", "--save-adapters-only")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.save_adapters_only and not self.enabled:
            raise ValueError("--save-adapters-only needs adapters: give --lora-rank R (R >= 1)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(self.targets.split(","))
