"""Tiny Hugging Face GPT-2, BERT and Llama built from configs (random init, no hub), and the checks of
tpzoo against them. Imported by test_models (inside the ranks), test_convert and test_convert_llama."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tpzoo.convert import from_hf, to_hf

VOCAB, HEADS = 101, 4
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Perturb every parameter (LayerNorm weights and biases included) so no mapping hides behind 1s and 0s."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def hf_gpt2(tie: bool = True) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=tie,
        attn_implementation="eager")
    return randomize(transformers.GPT2LMHeadModel(config))


def hf_bert(cls: type, tie: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
        tie_word_embeddings=tie, attn_implementation="eager")
    return randomize(cls(config))


def hf_llama(tie: bool = False, kv_heads: int = 2) -> transformers.LlamaForCausalLM:
    """LlamaForCausalLM with ``kv_heads`` of 4 heads, RoPE theta and RMSNorm epsilon off their defaults
    (a converter that dropped them would change the logits)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=kv_heads, max_position_embeddings=32, rms_norm_eps=1e-4, rope_theta=500.0,
        tie_word_embeddings=tie, attn_implementation="eager")
    return randomize(transformers.LlamaForCausalLM(config))


def mean_loss(per_token: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return per_token.sum() / (labels != -100).sum()


def check_hf(errors, mesh, x: dict[str, torch.Tensor], tmp: Path) -> None:
    """from_hf at this mesh's tp: logits and loss equal Hugging Face's; to_hf gives its state dict back."""
    ids, types, mask = x["ids"], x["types"], x["mask"]
    cases = []
    with torch.no_grad():
        hf = hf_gpt2()
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, labels=ids)
        cases.append((hf, model, {"logits": (model(ids), expected.logits),
                                  "loss": (mean_loss(model(ids, labels=x["next"]), x["next"]), expected.loss)}))
        hf = hf_bert(transformers.BertForPreTraining)
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, attention_mask=mask, token_type_ids=types)
        mlm, binary = model(ids, types, mask, return_binary_logits=True)
        cases.append((hf, model, {"logits": (mlm, expected.prediction_logits),
                                  "binary": (binary, expected.seq_relationship_logits)}))
        hf = hf_bert(transformers.BertForMaskedLM)
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, attention_mask=mask, token_type_ids=types, labels=x["mlm"])
        loss = mean_loss(model(ids, types, mask, labels=x["mlm"]), x["mlm"])
        cases.append((hf, model, {"logits": (model(ids, types, mask), expected.logits), "loss": (loss, expected.loss)}))
        hf = hf_bert(transformers.BertForSequenceClassification)
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, attention_mask=mask, token_type_ids=types, labels=x["cls"])
        loss = model(ids, types, mask, labels=x["cls"]).mean()
        cases.append((hf, model, {"logits": (model(ids, types, mask), expected.logits), "loss": (loss, expected.loss)}))
    for hf, model, outputs in cases:
        tag = f"{type(hf).__name__} tp={mesh.tp_size}"
        for name, (ours, theirs) in outputs.items():
            errors.check(ours, theirs, f"{tag} {name}", "tpzoo vs hf")
        out = to_hf(model, tmp / type(hf).__name__)
        back = type(hf).from_pretrained(out).state_dict()
        original = hf.state_dict()
        assert back.keys() == original.keys(), f"{tag}: to_hf keys differ {sorted(set(back) ^ set(original))}"
        for k in original:
            assert torch.equal(back[k], original[k]), f"{tag}: to_hf(from_hf(m)) changed {k}"
