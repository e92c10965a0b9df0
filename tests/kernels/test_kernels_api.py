"""The kernel API around the math: argument errors, backend dispatch, the import guard."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tpzoo import kernels as K
from tpzoo.kernels import dispatch

pytestmark = pytest.mark.tier("unit")



ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, **env: str) -> str:
    """stdout of ``code`` (dedented) in a fresh interpreter run from the repository root, which must succeed."""
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TPZOO_KERNELS")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env={**environ, **env},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("call, error, words", [
    (lambda: K.scaled_masked_softmax(torch.randn(2, 3, 4), None, 1.0), ValueError, "[2, 3, 4]"),
    (lambda: K.scaled_masked_softmax(torch.randn(2, 1, 4, 5), torch.zeros(3, 1, 1, 5, dtype=torch.bool), 1.0),
     ValueError, "[3, 1, 1, 5] does not broadcast to x of shape [2, 1, 4, 5]"),
    (lambda: K.scaled_masked_softmax(torch.randn(2, 1, 4, 5), torch.zeros(2, 1, 1, 5), 1.0), TypeError, "bool"),
    (lambda: K.scaled_causal_softmax(torch.ones(1, 1, 2, 2, dtype=torch.long), 1.0), TypeError, "floating-point"),
    (lambda: K.layer_norm(torch.randn(3, 8), torch.ones(7), torch.zeros(8), 1e-5), ValueError,
     "weight has shape [7] but x's hidden size (last dim) is 8"),
    (lambda: K.layer_norm(torch.randn(3, 8), torch.ones(8), torch.zeros(2, 4), 1e-5), ValueError,
     "bias has shape [2, 4]"),
    (lambda: K.rms_norm(torch.randn(3, 8), torch.ones(8, dtype=torch.long), 1e-5), TypeError, "weight"),
    (lambda: K.gelu(torch.randn(3), "sigmoid"), ValueError, "'sigmoid'"),
    (lambda: K.bias_gelu(torch.randn(3, 4), torch.randn(5), "tanh"), ValueError, "bias has shape [5]"),
])
def test_bad_arguments_raise_naming_the_sizes(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


def test_unknown_backend_value_is_named(monkeypatch):
    monkeypatch.setenv("TPZOO_KERNELS", "cuda")
    with pytest.raises(ValueError, match="TPZOO_KERNELS='cuda'.*auto, triton, torch"):
        K.gelu(torch.randn(3))


@pytest.mark.parametrize("env, expected", [("auto", "torch"), ("torch", "torch"), ("triton", "triton")])
def test_backend_choice_for_cpu_tensors(monkeypatch, env, expected):
    monkeypatch.setenv("TPZOO_KERNELS", env)
    x = torch.randn(4)
    assert dispatch.backend_for(x.device) == expected
    assert dispatch.use_triton(x) == (expected == "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_keyword_overrides_the_environment(monkeypatch, backend):
    monkeypatch.setenv("TPZOO_KERNELS", "triton" if backend == "torch" else "torch")
    x = torch.randn(4)
    assert dispatch.backend_for(x.device, backend) == backend
    assert dispatch.use_triton(x, backend) == (backend == "triton")
    assert torch.allclose(K.gelu(x, backend=backend), torch.nn.functional.gelu(x), atol=1e-6)
    with pytest.raises(ValueError, match="backend='cuda' is not a backend"):
        K.gelu(x, backend="cuda")


def test_empty_tensors_take_the_torch_path(monkeypatch):
    monkeypatch.setenv("TPZOO_KERNELS", "triton")
    x = torch.randn(0, 8, requires_grad=True)
    assert not dispatch.use_triton(x)
    y = K.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5)
    assert y.shape == (0, 8)


@pytest.mark.tier("journey")
def test_triton_on_cpu_turns_on_the_interpreter_by_itself():
    """With no CUDA and TRITON_INTERPRET unset, TPZOO_KERNELS=triton on CPU tensors sets it and runs."""
    out = run_python("""
        import os, torch
        from tpzoo import kernels as K
        assert "TRITON_INTERPRET" not in os.environ
        x = torch.randn(4, 33, requires_grad=True)
        y = K.bias_gelu(x, torch.zeros(33), "tanh")
        y.sum().backward()
        assert os.environ["TRITON_INTERPRET"] == "1"
        print(float((y - torch.nn.functional.gelu(x.detach(), approximate="tanh")).abs().max()))
    """, TPZOO_KERNELS="triton", CUDA_VISIBLE_DEVICES="")
    assert float(out) < 1e-6


@pytest.mark.tier("journey")
def test_triton_on_cpu_after_triton_was_imported_without_the_interpreter_says_how_to_fix():
    out = run_python("""
        import torch, torch._inductor.runtime.triton_heuristics  # imports triton, as torch.compile does
        from tpzoo import kernels as K
        try:
            K.gelu(torch.randn(4))
        except RuntimeError as e:
            print(e)
    """, TPZOO_KERNELS="triton", CUDA_VISIBLE_DEVICES="")
    assert "needs TRITON_INTERPRET=1 in the environment before triton is first imported" in out


@pytest.mark.tier("journey")
def test_top_level_kernels_folder_is_harmless_to_transformers():
    """From the repo root ``kernels/`` is findable as ``kernels``: it must never shadow the installed package of that
    name (Hugging Face's hub kernels, which transformers 5 requires and imports), nor pose as one when none is."""
    out = run_python("""
        import importlib, importlib.metadata, os, sys
        assert sys.path[0] == ""  # the repository root, where kernels/ is a top-level package
        import transformers
        from transformers.models.gpt2 import modeling_gpt2  # imports the hub kernels where installed
        try:
            importlib.metadata.version("kernels")
        except importlib.metadata.PackageNotFoundError:
            try:
                importlib.import_module("kernels")
                raise AssertionError("the repository's kernels/ posed as a top-level kernels package")
            except ModuleNotFoundError:
                pass
        else:
            top = importlib.import_module("kernels")
            assert os.path.dirname(top.__file__) != os.path.abspath("kernels"), top.__file__
        import tpzoo.kernels
        assert callable(tpzoo.kernels.gelu) and os.path.dirname(tpzoo.kernels.__file__) == os.path.abspath("kernels")
        print("ok")
    """)
    assert out.strip() == "ok"
