"""What bench/models.py measures tpzoo against: per family, the Hugging Face architecture and a plain
PyTorch model (nanoGPT style, no parallel machinery), both loaded with tpzoo's weights; and the
batches every contender reads.

    ref = REFERENCES[config.model_type]           # the family's references
    plain = ref.plain(config); load_hf(plain, hf_state, ref.renames, tied)

A batch (``make_batch``) is tpzoo's keyword arguments: causal-lm ``input_ids`` [b, s] and ``labels``
[b, s] (the next token, -100 at the end); masked-lm adds ``token_type_ids`` and ``attention_mask``,
and ``labels`` holds the token at 15% of the positions (-100 elsewhere). Plain models take
``(input_ids, labels)`` and return the mean loss over the labels that are not -100.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.models.config import ModelConfig


def mean_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross entropy of logits [b, s, V] against labels [b, s], averaged over labels != -100."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


class PlainGPTBlock(nn.Module):
    """Pre-LN GPT-2 layer: x + attn(ln_1(x)), then x + mlp(ln_2(x)); attention by torch sdpa."""

    def __init__(self, h: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(h, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch, nanoGPT style: learned positions, output layer tied to the embedding."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.wte, self.wpe = nn.Embedding(c.vocab_size, h), nn.Embedding(c.max_position_embeddings, h)
        self.h = nn.ModuleList(PlainGPTBlock(h, c.num_attention_heads, c.layernorm_epsilon)
                               for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(h, eps=c.layernorm_epsilon)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe.weight[: input_ids.shape[1]]
        for block in self.h:
            x = block(x)
        return mean_loss(F.linear(self.ln_f(x), self.wte.weight), labels)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary positions in the half-rotation layout (Hugging Face's): x cos + [-x2, x1] sin, x [b, n, s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class PlainLlamaBlock(nn.Module):
    """Llama layer: x + attn(rms(x)) with rotary q, k and grouped-query attention (g kv heads shared by
    n / g query heads each), then x + down(silu(gate(y)) * up(y)), y = rms(x)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h, n = c.hidden_size, c.num_attention_heads
        g, d, f = c.num_query_groups or n, h // n, c.ffn_hidden_size
        self.heads, self.groups = n, g
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=c.layernorm_epsilon), nn.RMSNorm(h, eps=c.layernorm_epsilon)
        self.q, self.k, self.v = nn.Linear(h, n * d, bias=False), nn.Linear(h, g * d, bias=False), nn.Linear(
            h, g * d, bias=False)
        self.o = nn.Linear(n * d, h, bias=False)
        self.gate, self.up, self.down = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(
            f, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q = rotate(self.q(y).view(b, s, self.heads, -1).transpose(1, 2), cos, sin)
        k = rotate(self.k(y).view(b, s, self.groups, -1).transpose(1, 2), cos, sin)
        v = self.v(y).view(b, s, self.groups, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class PlainLlama(nn.Module):
    """Llama in plain PyTorch: RMSNorm, rotary positions (base ``rotary_base``), GQA, SwiGLU."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h, d = c.hidden_size, c.hidden_size // c.num_attention_heads
        self.embed = nn.Embedding(c.vocab_size, h)
        self.layers = nn.ModuleList(PlainLlamaBlock(c) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(h, eps=c.layernorm_epsilon)
        self.lm_head = nn.Linear(h, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        inv_freq = 1.0 / c.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        angles = torch.outer(torch.arange(input_ids.shape[1], device=input_ids.device, dtype=torch.float32),
                             self.inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return mean_loss(self.lm_head(self.norm(x)), labels)


def load_hf(model: nn.Module, hf_state: dict[str, Tensor], renames: dict[str, str], tied: set[str]) -> None:
    """Load a Hugging Face state dict into a plain model: ``renames`` maps each Hugging Face name part to
    the plain one (applied in order); ``tied`` (tied repeats) is skipped; Conv1D weights ([in, out],
    under a "transpose:" rename) are transposed to Linear's [out, in]."""
    state = {}
    for key, t in hf_state.items():
        if key in tied:
            continue
        for theirs, ours in renames.items():
            if theirs in key:
                if ours.startswith("transpose:"):
                    ours = ours.removeprefix("transpose:")
                    t = t.t() if key.endswith("weight") else t
                key = key.replace(theirs, ours)
        state[key] = t
    model.load_state_dict(state)


@dataclass(frozen=True)
class Reference:
    """A family's references: the Hugging Face architecture (``tpzoo.convert.architectures()``) that
    tpzoo's model converts to, and a plain PyTorch model of the same weights (None: none here)."""

    hf_architecture: str
    plain: type[nn.Module] | None = None
    renames: dict[str, str] = field(default_factory=dict)   # Hugging Face name part -> plain (see load_hf)


_GPT_RENAMES = {"transformer.": "", "attn.c_attn": "transpose:c_attn", "attn.c_proj": "transpose:c_proj",
                "mlp.c_fc": "transpose:c_fc", "mlp.c_proj": "transpose:mlp_proj"}
_LLAMA_RENAMES = {"model.embed_tokens": "embed", "model.": "", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
                  "self_attn.v_proj": "v", "self_attn.o_proj": "o", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
                  "mlp.down_proj": "down", "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
# BERT: Hugging Face's BertForMaskedLM is what users pick; no plain model
REFERENCES: dict[str, Reference] = {
    "gpt": Reference("GPT2LMHeadModel", PlainGPT, _GPT_RENAMES),
    "bert": Reference("BertForMaskedLM"),
    "llama": Reference("LlamaForCausalLM", PlainLlama, _LLAMA_RENAMES),
    # the Llama-like families: their Hugging Face models (a plain Llama has no q/k/v biases, q/k norms or window)
    "qwen2": Reference("Qwen2ForCausalLM"),
    "qwen3": Reference("Qwen3ForCausalLM"),
    "mistral": Reference("MistralForCausalLM"),
    "mixtral": Reference("MixtralForCausalLM"),
}


def make_batch(kind: str, vocab: int, b: int, s: int, device: torch.device, seed: int = 0) -> dict[str, Tensor]:
    """tpzoo's keyword arguments for one micro-batch of ``kind`` (a family's ``data``: causal-lm or
    masked-lm) of random tokens, on ``device`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    if kind == "causal-lm":
        batch = dict(input_ids=ids, labels=torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1))
    elif kind == "masked-lm":
        labels = torch.where(torch.rand(b, s, generator=g) < 0.15, ids, -100)
        labels[:, 0] = ids[:, 0]                                 # at least one target per sequence
        batch = dict(input_ids=ids, token_type_ids=(torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
                     attention_mask=torch.ones(b, s, dtype=torch.long), labels=labels)
    else:
        raise ValueError(f"no benchmark batch for data kind {kind!r}; known: causal-lm, masked-lm")
    return {k: t.to(device) for k, t in batch.items()}


def hf_inputs(kind: str, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The Hugging Face model's keyword arguments for a batch of ``kind``: causal LMs shift the labels
    themselves, so they get the token ids as labels (the same targets as tpzoo's shifted ``labels``)."""
    return dict(input_ids=batch["input_ids"], labels=batch["input_ids"]) if kind == "causal-lm" else batch
