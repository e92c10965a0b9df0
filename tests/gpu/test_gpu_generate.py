"""``python -m tpzoo.generate`` on the device: greedy and sampled text (KV cache, a sampling generator
on the device) from the GPT of the pretrain runs."""

from __future__ import annotations

import pytest
from families import CAUSAL_LM
from gpu_helpers import run

PROMPT = "The film was"


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-k", "20", "--seed", "3"]],
                         ids=["greedy", "sampled"])
def test_generate_continues_the_prompt(pretrained, demo_files, work, sampling):
    done = run(["-m", "tpzoo.generate", "--load", str(pretrained(CAUSAL_LM.family, "bf16")), "--tokenizer-model",
                str(demo_files / "tokenizer.model"), "--prompt", PROMPT, "--max-new-tokens", "12", *sampling], work)
    print(done.stdout)
    assert PROMPT in done.stdout, done.stdout
    text = done.stdout[done.stdout.index(PROMPT):].strip()
    if sampling:  # greedy decoding may rightly stop at once (end of document); 20 candidates rarely all do
        assert len(text) > len(PROMPT), text
