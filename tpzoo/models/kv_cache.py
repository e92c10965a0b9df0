"""The keys and values of the tokens a GPT has already seen, for incremental decoding.

Per layer, this rank's heads only: keys and values [b, n/tp, t, d] after t tokens. A decoding
step feeds just the new tokens; attention reads the cached keys and values as well, and the
learned positions continue at t.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class KVCache:
    keys: dict[int, Tensor] = field(default_factory=dict)
    values: dict[int, Tensor] = field(default_factory=dict)
    length: int = 0  # tokens every layer has seen; the model (CausalLM) advances it after each forward

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's k, v [b, n/tp, s, d] for ``layer``; return all of them [b, n/tp, t + s, d]."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v
