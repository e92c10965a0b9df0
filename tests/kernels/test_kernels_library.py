"""The Triton kernels as PyTorch operators (kernels/library.py): torch.library.opcheck, torch.compile
(aot_eager and inductor, fullgraph=True), torch.export and FlopCounterMode, through Triton's interpreter.

Each check is named by what it checks and the op: ``-k opcheck``, ``-k "aot_eager and layer_norm"``,
``-k inductor``, ``-k export``, ``-k flop_counter``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tpzoo import kernels as K

pytestmark = pytest.mark.tier("unit")



TRITON = {"backend": "triton"}


def scores() -> torch.Tensor:
    return torch.randn(2, 2, 3, 5)


def rows() -> torch.Tensor:
    return torch.randn(3, 2, 8)


def vec(n: int = 8) -> torch.Tensor:
    return torch.randn(n)


def padding() -> torch.Tensor:
    return torch.tensor([[False] * 3 + [True] * 2, [False] * 5]).view(2, 1, 1, 5)


def _stats(x: torch.Tensor, rms: bool = False) -> list[torch.Tensor]:
    """The float32 statistics the forward saves: [mean, rstd] (LayerNorm) or [rstd] (RMSNorm)."""
    mean = torch.zeros(x.shape[:-1]) if rms else x.mean(-1)
    rstd = torch.rsqrt((x - mean[..., None]).square().mean(-1) + 1e-5)
    return [rstd] if rms else [mean, rstd]


# name: (op, arguments builder); differentiable inputs are made to require grad for the forward ops
OPCHECK_CASES = {
    "scaled_masked_softmax-mask": ("scaled_masked_softmax", lambda: [scores(), padding(), 0.5]),
    "scaled_masked_softmax-no-mask": ("scaled_masked_softmax", lambda: [scores(), None, 0.5]),
    "scaled_causal_softmax": ("scaled_causal_softmax", lambda: [scores(), 0.5]),
    "scaled_softmax_backward-causal": ("scaled_softmax_backward",
                                       lambda: [scores().softmax(-1), scores(), 0.5, True]),
    "scaled_softmax_backward-masked": ("scaled_softmax_backward",
                                       lambda: [scores().softmax(-1), scores(), 0.5, False]),
    "layer_norm-bias": ("layer_norm", lambda: [rows(), vec(), vec(), 1e-5]),
    "layer_norm-no-bias": ("layer_norm", lambda: [rows(), vec(), None, 1e-5]),
    "rms_norm": ("rms_norm", lambda: [rows(), vec(), 1e-5]),
    "layer_norm_backward-bias": ("layer_norm_backward",
                                 lambda: [rows(), x := rows(), vec(), vec(), *_stats(x)]),
    "layer_norm_backward-no-bias": ("layer_norm_backward",
                                    lambda: [rows(), x := rows(), vec(), None, *_stats(x)]),
    "rms_norm_backward": ("rms_norm_backward", lambda: [rows(), x := rows(), vec(), *_stats(x, rms=True)]),
    "bias_gelu-erf": ("bias_gelu", lambda: [rows(), vec(), False]),
    "bias_gelu-tanh-no-bias": ("bias_gelu", lambda: [rows(), None, True]),
    "bias_gelu_backward-erf": ("bias_gelu_backward", lambda: [rows(), rows(), vec(), False]),
    "bias_gelu_backward-tanh-no-bias": ("bias_gelu_backward", lambda: [rows(), rows(), None, True]),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    """Schema (no mutation, no aliasing), fake tensors vs the real kernel's outputs, the autograd
    registration, and aot_autograd with dynamic shapes against eager (forward and backward)."""
    name, build = OPCHECK_CASES[case]
    args = build()
    if not name.endswith("_backward"):  # the forward ops are differentiable in their float tensors
        args = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    torch.library.opcheck(getattr(torch.ops.tpzoo, name).default, args)


# public op name: (function of the differentiable inputs, their builder)
PUBLIC_OPS = {
    "scaled_masked_softmax": (lambda x: K.scaled_masked_softmax(x, padding(), 0.5, **TRITON), lambda: [scores()]),
    "scaled_causal_softmax": (lambda x: K.scaled_causal_softmax(x, 0.5, **TRITON), lambda: [scores()]),
    "layer_norm": (lambda x, w, b: K.layer_norm(x, w, b, 1e-5, **TRITON), lambda: [rows(), vec(), vec()]),
    "layer_norm-no-bias": (lambda x, w: K.layer_norm(x, w, None, 1e-5, **TRITON), lambda: [rows(), vec()]),
    "rms_norm": (lambda x, w: K.rms_norm(x, w, 1e-5, **TRITON), lambda: [rows(), vec()]),
    "bias_gelu": (lambda x, b: K.bias_gelu(x, b, "tanh", **TRITON), lambda: [rows(), vec()]),
    "gelu": (lambda x: K.gelu(x, "none", **TRITON), lambda: [rows()]),
}


def forward_backward(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """[y, d(sum(y * dy))/d input for each input] with a fixed dy."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    dy = torch.linspace(-1, 1, y.numel()).view(y.shape)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


@pytest.mark.parametrize("op", PUBLIC_OPS)
def test_aot_eager_fullgraph_equals_eager(op):
    """torch.compile(backend="aot_eager", fullgraph=True) runs the same kernels: bitwise equal, forward and backward."""
    fn, build = PUBLIC_OPS[op]
    inputs = build()
    torch._dynamo.reset()
    compiled = forward_backward(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs)
    for got, want in zip(compiled, forward_backward(fn, inputs), strict=True):
        assert torch.equal(got, want)


def block(x, w1, ln_w, ln_b, b1, w2):
    """A transformer MLP sublayer mixing the tpzoo ops with torch code: LN -> matmul -> bias-GELU -> matmul,
    a residual, RMSNorm and a causal softmax over the result seen as scores."""
    h = K.layer_norm(x, ln_w, ln_b, 1e-5, **TRITON)
    h = K.bias_gelu(h @ w1, b1, "tanh", **TRITON) @ w2 + x
    h = K.rms_norm(h * 2.0, ln_w, 1e-5, **TRITON)
    return K.scaled_causal_softmax(h.view(2, 1, 4, 8), 0.5, **TRITON).sum(-2) * 3.0 - 1.0


def block_inputs() -> list[torch.Tensor]:
    return [torch.randn(2, 4, 8), torch.randn(8, 16) / 3, 1 + vec() / 3, vec(), vec(16), torch.randn(16, 8) / 4]


@pytest.mark.tier("journey")
def test_inductor_fullgraph_mixed_with_torch_code():
    """inductor compiles the torch code around the ops (they stay opaque calls): eager results within 1e-6."""
    inputs = block_inputs()
    torch._dynamo.reset()
    compiled = forward_backward(torch.compile(block, backend="inductor", fullgraph=True), inputs)
    for got, want in zip(compiled, forward_backward(block, inputs), strict=True):
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


class Lambda(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(*inputs)


BLOCK_OPS = {"layer_norm", "bias_gelu", "rms_norm", "scaled_causal_softmax"}


def test_export_graph_names_the_ops():
    """torch.export keeps each op as one node named torch.ops.tpzoo.<op>; the exported program gives eager's output."""
    inputs = block_inputs()
    program = torch.export.export(Lambda(block), tuple(inputs))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {f"tpzoo.{op}.default" for op in BLOCK_OPS} <= targets, targets
    assert torch.equal(program.module()(*inputs), block(*inputs))


def test_aot_graphs_name_the_backward_ops():
    """aot_autograd's backward graph holds each backward op as one node named torch.ops.tpzoo.<op>_backward."""
    from functorch.compile import aot_function, make_boxed_func

    seen: dict[str, set[str]] = {"forward": set(), "backward": set()}

    def record(part: str):
        def compiler(gm, _):
            seen[part].update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm)
        return compiler

    inputs = [t.requires_grad_() for t in block_inputs()]
    aot_function(block, fw_compiler=record("forward"), bw_compiler=record("backward"))(*inputs).sum().backward()
    assert {f"tpzoo.{op}.default" for op in BLOCK_OPS} <= seen["forward"], seen["forward"]
    backward = {f"tpzoo.{op}_backward.default" for op in ("layer_norm", "bias_gelu", "rms_norm", "scaled_softmax")}
    assert backward <= seen["backward"], seen["backward"]


def test_flop_counter_sees_the_ops():
    """FlopCounterMode dispatches each op by name (a formula given for it counts), forward and backward;
    the two matmuls count as usual: 2 m n k each forward, twice that backward."""
    inputs = [t.requires_grad_() for t in block_inputs()]
    given = {getattr(torch.ops.tpzoo, op): n for n, op in enumerate(
        ("layer_norm", "layer_norm_backward", "rms_norm_backward", "scaled_causal_softmax"), start=1)}
    with FlopCounterMode(display=False, custom_mapping={op: lambda *a, n=n, **k: n for op, n in given.items()}) as c:
        block(*inputs).sum().backward()
    counts = c.get_flop_counts()["Global"]
    assert all(counts.get(op) == n for op, n in given.items()), counts
    assert counts[torch.ops.aten.mm] == 3 * 2 * (2 * (2 * 4) * 8 * 16), counts


@pytest.mark.parametrize("env, traced", [("triton", True), ("torch", False)])
def test_export_follows_tpzoo_kernels_environment(monkeypatch, env, traced):
    """With no backend argument the exported graph holds the op under TPZOO_KERNELS=triton, torch code otherwise."""
    monkeypatch.setenv("TPZOO_KERNELS", env)
    program = torch.export.export(Lambda(lambda x, w: K.rms_norm(x, w, 1e-5)), (rows(), vec()))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert ("tpzoo.rms_norm.default" in targets) == traced, targets
