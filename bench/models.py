"""Training-step time of tpzoo's GPT (tp=1) against Hugging Face transformers and a plain PyTorch GPT.

    python bench/models.py                                    # CPU: a small GPT-2; GPU: gpt2, bf16
    python bench/models.py --preset gpt2 --batch-size 8 --seq-length 1024

All three models have the same shape and the same weights (tpzoo's, converted), and start from
the same loss. One step = forward with the loss, backward, AdamW step. The three take turns
step by step; reported are the best and the median time per step, and the ratios of the best
times tpzoo/Hugging Face and tpzoo/plain (below 1: tpzoo is faster; the best time is the one
least disturbed by other processes). On a GPU also tokens/s and MFU: (6 N + 12 L h s) FLOPs
per token (N parameters in matrix multiplies, L layers, h hidden, s sequence) over the device's
peak bf16 rate.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tpzoo.convert import tpzoo_to_hf
from tpzoo.models import GPTModel, TransformerConfig, full_state_dict, get_preset, num_parameters
from tpzoo.parallel import ParallelPlan, init_mesh

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(h, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch, nanoGPT style: the baseline without any parallel machinery."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.hidden_size), nn.Embedding(c.max_position_embeddings,
                                                                                      c.hidden_size)
        self.h = nn.ModuleList(PlainBlock(c.hidden_size, c.num_attention_heads, c.layernorm_epsilon)
                               for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.hidden_size, eps=c.layernorm_epsilon)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def load_hf(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Hugging Face GPT-2 weights: Conv1D [in, out] -> Linear [out, in]."""
        names = {"attn.c_attn": "c_attn", "attn.c_proj": "c_proj", "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}
        state = {}
        for key, t in hf_state.items():
            key = key.removeprefix("transformer.")
            for theirs, ours in names.items():
                if f".{theirs}." in key:
                    key = key.replace(theirs, ours)
                    t = t.t() if key.endswith("weight") else t
            state[key] = t
        state.pop("lm_head.weight")
        self.load_state_dict(state)


def build(config: TransformerConfig, plan: ParallelPlan) -> dict[str, nn.Module]:
    """tpzoo, Hugging Face and plain GPTs with tpzoo's weights."""
    import transformers

    transformers.logging.set_verbosity_error()
    device = plan.mesh.device
    tpzoo = GPTModel(config, plan)
    hf_config, hf_state, _ = tpzoo_to_hf("GPTModel", {}, config, full_state_dict(tpzoo))
    hf = transformers.GPT2LMHeadModel(hf_config)
    hf.load_state_dict(hf_state)
    plain = PlainGPT(config)
    plain.load_hf(hf_state)
    return {"tpzoo": tpzoo, "hf": hf.to(device), "plain": plain.to(device)}


def losses(models: dict[str, nn.Module], ids: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    return {
        "tpzoo": lambda: models["tpzoo"](ids, labels=labels).sum() / (labels != -100).sum(),
        "hf": lambda: models["hf"](ids, labels=ids).loss,
        "plain": lambda: models["plain"](ids),
    }


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--num-layers", type=int, default=None if cuda else 2)
    p.add_argument("--hidden-size", type=int, default=None if cuda else 256)
    p.add_argument("--num-attention-heads", type=int, default=None if cuda else 4)
    p.add_argument("--vocab-size", type=int, default=None if cuda else 8192)
    p.add_argument("--batch-size", type=int, default=8 if cuda else 4)
    p.add_argument("--seq-length", type=int, default=1024 if cuda else 128)
    p.add_argument("--steps", type=int, default=20 if cuda else 6, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3 if cuda else 2, help="untimed steps per model, the first included")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=cuda, help="autocast to bfloat16")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "fused-softmax", "sdpa"])
    p.add_argument("--kernels", default=None, choices=["auto", "triton", "torch"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    mesh = init_mesh(tp=1)
    overrides = {k: v for k, v in dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                       num_attention_heads=args.num_attention_heads,
                                       vocab_size=args.vocab_size).items() if v is not None}
    config = get_preset(args.preset, **overrides, hidden_dropout=0.0, attention_dropout=0.0)
    models = build(config, ParallelPlan(mesh, attention_backend=args.attention_backend, kernels=args.kernels))
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_length),
                        generator=torch.Generator().manual_seed(0)).to(mesh.device)
    step_loss = losses(models, ids)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    autocast = torch.autocast(mesh.device.type, torch.bfloat16, enabled=args.bf16)

    def step(name: str) -> tuple[float, float]:
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        with autocast:
            loss = step_loss[name]()
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start, loss.item()

    first = {name: step(name)[1] for name in models}  # same weights, same batch: the same loss
    for _ in range(args.warmup - 1):
        for name in models:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.steps):
        for name in models:
            times[name].append(step(name)[0])
    best = {name: min(t) for name, t in times.items()}
    med = {name: statistics.median(t) for name, t in times.items()}

    tokens = args.batch_size * args.seq_length
    matmul_params = num_parameters(config) - config.max_position_embeddings * config.hidden_size
    flops = 6 * matmul_params + 12 * config.num_layers * config.hidden_size * args.seq_length
    peak = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name()), None)
    device = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(f"GPT {config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, "
          f"vocab {config.vocab_size} ({num_parameters(config):,} parameters); batch {args.batch_size} x "
          f"{args.seq_length} tokens; {'bf16' if args.bf16 else 'float32'}; {device}; {args.steps} steps each")
    print(f"{'model':8}{'best ms':>10}{'median ms':>11}{'tokens/s':>12}{'MFU':>8}{'loss@0':>10}")
    for name in models:
        mfu = f"{flops * tokens / best[name] / peak:.1%}" if peak and args.bf16 else "-"
        print(f"{name:8}{best[name] * 1e3:10.1f}{med[name] * 1e3:11.1f}{tokens / best[name]:12,.0f}{mfu:>8}"
              f"{first[name]:10.4f}")
    # The best of the steps is the time without interference from other processes (a shared CPU).
    print(f"ratios (best time per step, below 1 = tpzoo faster): tpzoo/hf = {best['tpzoo'] / best['hf']:.2f}, "
          f"tpzoo/plain = {best['tpzoo'] / best['plain']:.2f}")

if __name__ == "__main__":
    main()
