"""Hugging Face <-> tpzoo conversion rules, on full (unsharded) state dicts: pure functions, no process group.

Every tpzoo tensor is one ``Rule``: its name, the Hugging Face names it comes from, and the two
exact (bitwise) transforms between them. Each family lists its rules in its own module (its
``HFAdapter`` in ``tpzoo.models.families``); ``tpzoo.convert`` applies them. The layouts that differ:

- fused QKV: tpzoo keeps [(n + 2g) d, h] group by group (``heads_from_qkv``): for kv head j, the
  n/g query heads it serves, then k_j, then v_j, d rows each; with g = n head by head,
  [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]. So a contiguous 1/tp of the rows holds whole groups.
  Hugging Face keeps [q; k; v] in one Conv1D (GPT-2) or separate projections (BERT, Llama).
- gated MLPs: tpzoo's one [2f, h] weight interleaves the rows of gate and up ([g_0 u_0 g_1 u_1 ...],
  ``gated``); Hugging Face keeps gate_proj and up_proj.
- GPT-2's Conv1D stores weights [in, out]; tpzoo (like nn.Linear) [out, in]: transposed.
- tied weights are one tensor in tpzoo, written back under each Hugging Face name (``tied``).

Only values move: every transform is a permutation, so a round trip is bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

# Buffers some transformers versions save next to the weights (GPT-2's causal masks, rotary
# frequencies): no weights, so a checkpoint may hold them and conversion drops them.
HF_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
GELU_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


class ConversionError(ValueError):
    """A checkpoint or config that tpzoo cannot represent exactly."""


def require(ok: bool, what: str) -> None:
    """ConversionError "unsupported Hugging Face config: ``what``" unless ``ok``."""
    if not ok:
        raise ConversionError(f"unsupported Hugging Face config: {what}")


def gelu_from_hf(name: str) -> str:
    """tpzoo's activation for a Hugging Face GELU name (``GELU_FROM_HF``)."""
    if name not in GELU_FROM_HF:
        raise ConversionError(f"activation {name!r} has no tpzoo equivalent; supported: {sorted(GELU_FROM_HF)}")
    return GELU_FROM_HF[name]


def gelu_to_hf(activation: str) -> str:
    return "gelu_new" if activation == "gelu_tanh" else "gelu"


def transformers_module() -> Any:
    """The transformers package (configs need it), or an ImportError saying how to get it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("Hugging Face conversion needs transformers: pip install transformers") from e
    return transformers


def is_classifier(arch: str) -> bool:
    """Whether Hugging Face class ``arch`` is a sequence classifier (``...ForSequenceClassification``)."""
    return arch.endswith("ForSequenceClassification")


def labels_from_hf(hf: Any, arch: str) -> dict[str, Any]:
    """The config fields of a classifier ``arch``'s classes ({} for another class); regression and multi-label
    problems are refused."""
    if not is_classifier(arch):
        return {}
    require(getattr(hf, "problem_type", None) in (None, "single_label_classification"),
            f"problem_type={hf.problem_type!r}")
    require(hf.num_labels >= 2, "num_labels=1 (regression)")
    return dict(num_labels=hf.num_labels)


def labels_to_hf(c: Any, arch: str) -> dict[str, Any]:
    """``labels_from_hf``'s inverse: a Hugging Face config's fields of a classifier's classes."""
    return dict(num_labels=c.num_labels) if is_classifier(arch) else {}


@dataclass(frozen=True)
class Rule:
    """tpzoo tensor ``tpzoo`` = ``to_tpzoo(*hf tensors)``; the hf tensors = ``to_hf(tpzoo tensor)``.

    ``tied``: the hf names all hold the same tensor (only the first need be present). ``transposed``: Hugging Face
    holds the weight [in, out] (GPT-2's Conv1D), so ``to_hf`` of a [out, r] tensor gives [r, out] pieces.
    """

    tpzoo: str
    hf: tuple[str, ...]
    to_tpzoo: Callable[..., Tensor]
    to_hf: Callable[[Tensor], tuple[Tensor, ...]]
    tied: bool = False
    transposed: bool = False


def same(tpzoo: str, hf: str, transpose: bool = False) -> Rule:
    """One tensor under another name (``transpose``: [in, out] <-> [out, in])."""
    move = (lambda t: t.t().contiguous()) if transpose else (lambda t: t.clone())
    return Rule(tpzoo, (hf,), move, lambda t: (move(t),), transposed=transpose)


def linear(ours: str, theirs: str) -> list[Rule]:
    """The weight and bias of a linear (or LayerNorm) module ``ours`` <- ``theirs``."""
    return [same(f"{ours}.{p}", f"{theirs}.{p}") for p in ("weight", "bias")]


def tied(tpzoo: str, *hf: str) -> Rule:
    """One tpzoo tensor that Hugging Face holds under each of ``hf`` (the first one saved)."""
    return Rule(tpzoo, hf, lambda t: t.clone(), lambda t: tuple(t.clone() for _ in hf), tied=True)


def heads_from_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, groups: int | None = None) -> Tensor:
    """q [n d, ...], k and v [g d, ...] (heads contiguous; g = ``groups``, default n) -> [(n + 2g) d, ...]
    laid out group by group: [q heads of group 0 | k_0 | v_0 | q heads of group 1 | k_1 | v_1 | ...]."""
    g = groups or heads
    rest = q.shape[1:]
    if heads % g or q.shape[0] % heads or k.shape != v.shape or k.shape[0] * heads != q.shape[0] * g:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not the projections of "
                         f"{heads} query heads and {g} kv heads of equal size")
    return torch.cat([t.reshape(g, -1, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def qkv_from_heads(w: Tensor, heads: int, groups: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``heads_from_qkv``: [(n + 2g) d, ...] -> (q [n d, ...], k [g d, ...], v [g d, ...])."""
    g = groups or heads
    rest = w.shape[1:]
    if heads % g or w.shape[0] % (heads + 2 * g):
        raise ValueError(f"a fused QKV of {w.shape[0]} rows does not hold {heads} query heads and 2 x {g} kv heads")
    d = w.shape[0] // (heads + 2 * g)
    parts = w.reshape(g, -1, *rest).split([heads // g * d, d, d], dim=1)
    q, k, v = (t.reshape(-1, *rest).clone() for t in parts)
    return q, k, v


def qkv(tpzoo: str, hf: tuple[str, str, str], heads: int, groups: int | None = None) -> Rule:
    """tpzoo's fused QKV weight or bias <- Hugging Face's separate q, k, v projections (``hf``)."""
    return Rule(tpzoo, hf, lambda q, k, v: heads_from_qkv(q, k, v, heads, groups),
                lambda w: qkv_from_heads(w, heads, groups))


def gated(tpzoo: str, gate: str, up: str) -> Rule:
    """tpzoo's [2f, h] gated-MLP weight, rows [g_0 u_0 g_1 u_1 ...] <- Hugging Face's gate and up [f, h]."""
    return Rule(tpzoo, (gate, up), lambda g, u: torch.stack((g, u), 1).reshape(-1, *g.shape[1:]),
                lambda w: tuple(t.clone() for t in w.reshape(-1, 2, *w.shape[1:]).unbind(1)))


def _shown(names: list[str]) -> str:
    return f"{names[:6]}{' ...' if len(names) > 6 else ''}"


def state_dict_from_hf(hf_state: dict[str, Tensor], rules: list[Rule], what: str) -> dict[str, Tensor]:
    """Hugging Face state dict -> tpzoo full state dict (float32) by ``rules``; ``what`` (the
    architecture) names the checkpoint in errors. Tied repeats may be absent, as in saved files."""
    needed = {name for r in rules for name in (r.hf[:1] if r.tied else r.hf)}
    missing = sorted(needed - set(hf_state))
    if missing:
        raise ConversionError(f"the {what} checkpoint lacks {_shown(missing)}")
    known = {name for r in rules for name in r.hf}
    extra = sorted(k for k in hf_state if k not in known and not k.endswith(HF_BUFFERS))
    if extra:
        raise ConversionError(f"the {what} checkpoint has tensors tpzoo has no place for: {_shown(extra)}")
    return {r.tpzoo: r.to_tpzoo(*(hf_state[k].detach().float() for k in (r.hf[:1] if r.tied else r.hf)))
            for r in rules}


def state_dict_to_hf(state: dict[str, Tensor], rules: list[Rule]) -> dict[str, Tensor]:
    """tpzoo full state dict -> Hugging Face state dict by ``rules``, tied tensors under each of their names."""
    out: dict[str, Tensor] = {}
    for r in rules:
        out.update(zip(r.hf, r.to_hf(state[r.tpzoo])))
    return out


def tied_repeats(rules: list[Rule]) -> set[str]:
    """Hugging Face names that repeat a tied tensor: saved files leave them out, as Hugging Face does."""
    return {name for r in rules if r.tied for name in r.hf[1:]}
