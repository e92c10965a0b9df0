"""Generation: KV-cache decoding equals full recomputation, text is the same at tp=1 and tp=2 for every
causal-LM family (GPT, Llama: ``families.CAUSAL``), a model of another kind is refused, and the tokenizer
defaults to the checkpoint's (or the model folder's) and must have the model's vocabulary."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_helpers import small_corpus
from families import CASES, DECODER_CLASSIFIER, MAIN
from pretrain_helpers import TINY, pretrain

from tpzoo.data.demo import demo_data
from tpzoo.data.tokenizer import load_tokenizer
from tpzoo.generate import check_causal_lm, filter_logits, generate
from tpzoo.models import CausalLM, KVCache
from tpzoo.models.pretrained import save_pretrained
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("journey")



ROOT = Path(__file__).resolve().parents[1]
CAUSAL = [name for name in MAIN if CASES[name].inputs == "causal-lm"]  # one case per causal-LM family
SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=32, hidden_dropout=0.0,
             attention_dropout=0.0)


def tiny(case: str, vocab: int = 97):
    return CASES[case].config(vocab_size=vocab, **SIZES)


def build(case: str, mesh, backend: str, vocab: int = 97) -> CausalLM:
    return CASES[case].build(tiny(case, vocab), ParallelPlan(mesh, attention_backend=backend, seed=7))


def greedy_without_cache(model: CausalLM, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def generation_checks(model_dir: str) -> None:
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for case in CAUSAL:
        kv_heads = getattr(tiny(case), "query_groups", SIZES["num_attention_heads"])  # grouped-query attention
        for tp in (1, 2):
            mesh = init_mesh(tp=tp)
            for backend in ("sdpa", "fused-softmax"):
                model, tag = build(case, mesh, backend).eval(), f"{case} tp={tp} {backend}"
                with torch.no_grad():
                    full = model(ids)
                    cache, pieces = KVCache(), []
                    for a, b in ((0, 3), (3, 5), *((t, t + 1) for t in range(5, 9))):  # prefill, a chunk, tokens
                        pieces.append(model(ids[:, a:b], cache=cache))
                err = (torch.cat(pieces, dim=1) - full).abs().max() / full.abs().max()
                assert err < 1e-5, f"{tag}: cached decoding differs from the full forward by {err:.2e}"
                assert cache.length == 9 and cache.keys[1].shape == (2, kv_heads // tp, 9, tiny(case).head_dim), tag
                greedy = generate(model, ids[:, :4], 6)
                assert torch.equal(greedy, greedy_without_cache(model, ids[:, :4], 6)), f"{tag} greedy"
                sampled = generate(model, ids[:, :4], 6, temperature=0.8, top_k=20, top_p=0.9, seed=3)
                outputs[case, tp, backend] = (greedy, sampled)
        for backend in ("sdpa", "fused-softmax"):
            assert all(torch.equal(a, b) for a, b in zip(outputs[case, 1, backend], outputs[case, 2, backend])), \
                f"{case} {backend}: tp=2 generates other tokens than tp=1"
    with pytest.raises(ValueError, match="prompt of 9 tokens \\+ max_new_tokens=30 exceeds max_position_embeddings=32"):
        generate(model, ids, 30)
    encoder = CASES[next(name for name in MAIN if CASES[name].inputs != "causal-lm")]
    for refused in (encoder, DECODER_CLASSIFIER):  # an encoder, a decoder's classifier: nothing to decode
        with pytest.raises(ValueError, match=f"holds a {refused.model}; generation needs a causal LM"):
            check_causal_lm(refused.build(refused.config(), ParallelPlan(init_mesh(tp=1))), "model-dir")
    vocab = load_tokenizer(demo_data()[0]).vocab_size
    save_pretrained(build(CAUSAL[0], init_mesh(tp=1), "auto", vocab), model_dir)


ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}


def generate_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpzoo.generate", *args], capture_output=True, text=True,
                          timeout=120, env=ENV)


def test_cached_decoding_and_generation_at_tp_1_and_2(tmp_path):
    """tp=1 with --tokenizer-model, tp=2 with the tokenizer copied into the model folder: the same text."""
    spawn(generation_checks, 2, str(tmp_path / "causal-lm"), timeout=300)
    tokenizer = demo_data()[0]
    common = ["--load", str(tmp_path / "causal-lm"), "--prompt", "the small dog", "--max-new-tokens", "8"]
    one = generate_command(*common, "--tokenizer-model", tokenizer)
    assert one.returncode == 0, one.stderr
    shutil.copy(tokenizer, tmp_path / "causal-lm")
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "tpzoo.generate", "--tp", "2", *common], capture_output=True, text=True,
                         timeout=120, env=ENV)
    assert two.returncode == 0, two.stderr[-2000:]
    text = one.stdout.strip()
    assert text.startswith("the small dog") and len(text) > len("the small dog"), text
    assert two.stdout.strip() == one.stdout.strip(), "tp=2 greedy text differs from tp=1"

    bad = generate_command("--load", str(tmp_path / "nope"), "--tokenizer-model", tokenizer, "--prompt", "x")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "nope" in bad.stderr, bad.stderr


@pytest.mark.tier("unit")
def test_filter_logits_keeps_top_k_and_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.85)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits[:, [3, 0, 2, 1]], top_p=0.7)).tolist() == [[False, True, False, True]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny GPT checkpoint of pretrain.py (one iteration on the demo corpus): its meta.json records the tokenizer."""
    root = tmp_path_factory.mktemp("generate")
    pretrain(TINY + "--train-iters 1 --eval-interval 0 --save ckpt".split(), root)
    return root / "ckpt"


def test_generate_uses_the_tokenizer_the_checkpoint_records(checkpoint):
    done = generate_command("--load", str(checkpoint), "--prompt", "the small dog", "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("the small dog") and len(done.stdout.strip()) > len("the small dog"), done.stdout


def test_generate_refuses_a_tokenizer_of_another_vocabulary(checkpoint):
    other = small_corpus()["tokenizer"]  # a 300-piece BPE; the checkpoint's model has the demo's 512
    done = generate_command("--load", str(checkpoint), "--tokenizer-model", other, "--prompt", "the small dog")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "300 tokens" in done.stderr and "has 512" in done.stderr and "--tokenizer-model" in done.stderr, done.stderr
