"""Megatron-LM's BERT entry point by name: ``torchrun ... pretrain_bert.py <Megatron-LM flags>`` runs
pretrain.py with ``--model bert`` by default (the same flags; docs/megatron.md)."""

import pretrain

if __name__ == "__main__":
    pretrain.main(prog="pretrain_bert.py", model="bert")
