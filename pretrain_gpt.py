"""Megatron-LM's GPT entry point by name: ``torchrun ... pretrain_gpt.py <Megatron-LM flags>`` runs
pretrain.py with ``--model gpt`` by default (the same flags; docs/megatron.md)."""

import pretrain

if __name__ == "__main__":
    pretrain.main(prog="pretrain_gpt.py", model="gpt")
