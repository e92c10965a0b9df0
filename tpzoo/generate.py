"""Text from a causal LM of any family (GPT, Llama: a family whose data kind is "causal-lm" in
``tpzoo.models.families``): greedy, temperature, top-k and top-p sampling over a KV cache, at any tp.

    python -m tpzoo.generate --load MODEL --prompt "the cat"
    torchrun --standalone --nproc-per-node 2 -m tpzoo.generate --tp 2 --load MODEL ...

Every tp rank sees the same gathered logits and draws from a generator seeded alike, so all
ranks pick the same tokens; rank 0 prints. MODEL is a training checkpoint (``--save`` dir or one of
its iter_NNNNNNN folders) or a tpzoo model folder (``save_pretrained`` or ``python -m tpzoo.convert
from-hf``), loaded by ``tpzoo.checkpoint.load_model`` whatever mesh saved it. The tokenizer is the one
the checkpoint records, or one inside the model folder, unless ``--tokenizer-model`` names another;
its vocabulary must be the model's (``tpzoo.checkpoint.tokenizer.model_tokenizer``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.models import CausalLM, KVCache
from tpzoo.models.causal_lm import SequenceClassifier
from tpzoo.models.families import FAMILIES, family
from tpzoo.models.family_flag import add_model_flag

PROG = "python -m tpzoo.generate"


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """logits [b, V] with everything outside the top-k tokens and the top-p nucleus set to -inf."""
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p   # the tokens before already hold top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate(model: CausalLM, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None, seed: int = 0) -> Tensor:
    """input_ids [b, s] -> [b, s + n], n <= max_new_tokens (fewer once every row has emitted ``eos_id``).

    temperature 0 is greedy (argmax); otherwise sample softmax(logits / temperature) after top-k /
    top-p filtering, from a generator seeded with ``seed``.
    """
    if getattr(model, "plan", None) is not None and model.plan.sequence_parallel:  # a plain model: one device
        raise ValueError("generation decodes one token at a time: build the model with a plan of "
                         "sequence_parallel=False")
    if getattr(model, "mesh", None) is not None and model.mesh.cp_size > 1:
        raise ValueError(f"generation decodes one sequence whole, not split over cp={model.mesh.cp_size} "
                         f"context-parallel ranks: load the model on a mesh with cp 1 (drop --context-parallel-size)")
    if not temperature >= 0 or not 0.0 < top_p <= 1.0 or top_k < 0 or max_new_tokens < 0:  # NaN fails too
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0 and max_new_tokens >= 0; got "
                         f"temperature={temperature}, top_p={top_p}, top_k={top_k}, max_new_tokens={max_new_tokens}")
    limit = model.config.max_position_embeddings
    if input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt of {input_ids.shape[1]} tokens + max_new_tokens={max_new_tokens} exceeds "
                         f"max_position_embeddings={limit}")
    model.eval()
    generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    cache, out, step = KVCache(), input_ids, input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(step, cache=cache)[:, -1].float()                 # [b, V], the same on every tp rank
        if temperature == 0:
            token = logits.argmax(dim=-1)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        if eos_id is not None:
            token = token.masked_fill(done, eos_id)
            done |= token == eos_id
        out = torch.cat([out, token[:, None]], dim=1)
        step = token[:, None]
        if eos_id is not None and bool(done.all()):
            break
    return out


def check_causal_lm(model: torch.nn.Module, load: str) -> None:
    """ValueError unless ``model`` is a causal LM (KV cache) of a causal-LM family, not its classifier: what
    generation decodes."""
    if not (isinstance(model, CausalLM) and not isinstance(model, SequenceClassifier)
            and family(model.config.model_type).data == "causal-lm"):
        causal = ", ".join(f.name for f in FAMILIES.values() if f.data == "causal-lm")
        raise ValueError(f"{load} holds a {type(model).__name__}; generation needs a causal LM (a model of {causal})")


def main(argv: list[str] | None = None) -> None:
    from tpzoo.checkpoint import load_model
    from tpzoo.checkpoint.tokenizer import model_tokenizer
    from tpzoo.parallel import init_mesh
    from tpzoo.flag_types import (non_negative_float, non_negative_int, positive_float, positive_int, seed,
                                  utf8_text)
    from tpzoo.training.args import command_parser, exit_on_misuse

    parser = command_parser(PROG, "text from a tpzoo causal LM")
    parser.add_argument("--load", required=True, help="training checkpoint (save dir or iter_NNNNNNN folder) or "
                        "tpzoo model folder (config.json + model.safetensors)")
    parser.add_argument("--tokenizer-model", help="sentencepiece .model or Hugging Face tokenizer dir (default: the "
                        "one the checkpoint records, or the one in the model folder)")
    add_model_flag(parser)
    parser.add_argument("--prompt", required=True, type=utf8_text)
    parser.add_argument("--max-new-tokens", type=non_negative_int, default=32)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=positive_int, default=1)
    parser.add_argument("--context-parallel-size", "--cp", dest="cp", type=positive_int, default=1,
                        help="refused above 1: generation decodes one sequence whole")
    parser.add_argument("--distributed-timeout-minutes", type=positive_float, default=10.0,
                        help="a collective waiting this long on a peer fails (default: 10)")
    args = parser.parse_args(argv)

    def run() -> tuple[Tensor, Any]:
        if args.cp > 1:
            raise ValueError(f"--context-parallel-size {args.cp}: generation decodes one sequence whole, not split "
                             f"over context-parallel ranks; drop it")
        mesh = init_mesh(tp=args.tp, timeout=timedelta(minutes=args.distributed_timeout_minutes))
        model = load_model(args.load, mesh)
        check_causal_lm(model, args.load)
        tokenizer = model_tokenizer(args.load, args.tokenizer_model, vocab_size=model.config.vocab_size)
        ids = torch.tensor([tokenizer.encode(args.prompt)], device=mesh.device)
        if ids.shape[1] == 0:
            raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
        return generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, eos_id=tokenizer.eod, seed=args.seed), tokenizer

    out, tokenizer = exit_on_misuse(PROG, run)  # one line on rank 0, exit 2 on every rank
    if dist.get_rank() == 0:
        print(tokenizer.decode(out[0].tolist()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
