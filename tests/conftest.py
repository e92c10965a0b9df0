"""Test setup shared by the whole suite.

TRITON_INTERPRET=1 must be in the environment before any @triton.jit decorator runs, i.e.
before anything imports the Triton kernel modules: the kernel tests run on the CPU through
Triton's interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
