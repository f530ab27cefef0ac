"""The gated activation and the down projection's rank-space product ``U = h A^T`` in one launch
(``notebookkit.kernels.gated_low_rank``): ``h`` equal to the activation kernel's (SwiGLU, GeGLU exact and tanh) bit
for bit, ``U`` held to the rounding bound of one fp32 sum of the *rounded* ``h`` rounded once (the bound of
test_add_rms_norm_low_rank.py); rows the kernel does not take run the pair. Under the interpreter (CPU) and on
CUDA."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.gated_low_rank import gated_low_rank, gated_low_rank_supported
from notebookkit.kernels.geglu import geglu
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.swiglu import swiglu

from tests.kernels.test_add_rms_norm_low_rank import assert_u_within_rounding

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")


def _inputs(n, r, dtype, device, seed=0):
    """A decode row ``e, g [1, 1, n]`` and the down adapter's ``A [r, n]`` (rows n + 5 apart: a view)."""
    gen = torch.Generator().manual_seed(seed)
    e = (torch.randn(1, 1, n, generator=gen) * 2).to(dtype).to(device)
    g = torch.randn(1, 1, n, generator=gen).to(dtype).to(device)
    a = (torch.randn(r, n + 5, generator=gen) * 0.05).to(dtype).to(device)[:, :n]
    return e, g, a


def _activation(e, g, activation):
    return swiglu(e, g) if activation == "swiglu" else geglu(e, g, approximate="tanh" if "tanh" in activation else "none")


CASES = [  # (I, R, dtype, activation): one tile with masked columns, several tiles, each activation
    (37, 4, torch.float32, "swiglu"),
    (2500, 16, torch.float16, "swiglu"),
    (300, 8, torch.bfloat16, "geglu"),
    (4100, 5, torch.float16, "geglu_tanh"),
]


@needs_interpreter
@pytest.mark.parametrize("n,r,dtype,activation", CASES, ids=[f"I{n}-R{r}-{str(d)[6:]}-{a}" for n, r, d, a in CASES])
def test_h_is_the_activation_kernels_and_u_the_product_of_its_rounded_output(n, r, dtype, activation):
    e, g, a = _inputs(n, r, dtype, "cpu")
    with use_triton(True):
        assert gated_low_rank_supported(e, g, a, activation)
        h, u = gated_low_rank(e, g, a, activation)
        h_ref = _activation(e, g, activation)
    assert h.shape == e.shape and h.dtype == dtype and torch.equal(h, h_ref)
    assert_u_within_rounding(u, h, a)


@needs_interpreter
def test_two_rows_run_the_pair_and_an_unknown_activation_is_refused():
    e, g, a = _inputs(64, 8, torch.float16, "cpu")
    two = torch.cat([e, g], dim=1)
    with use_triton(True):
        assert not gated_low_rank_supported(two, two, a, "swiglu")
        h, u = gated_low_rank(two, two, a, "swiglu")
    assert u.shape == (2, 8) and torch.allclose(u.float(), (h.reshape(2, -1) @ a.t()).float(), atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="unknown activation"):
        gated_low_rank(e, g, a, "relu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,r", [(8192, 16), (14336, 16)])
def test_the_decode_rows_on_the_gpu(dtype, n, r):
    """The Llama-3.2-1B and 8B MLP rows: ``h`` bit for bit the SwiGLU kernel's, ``U`` within one rounding."""
    e, g, a = _inputs(n, r, dtype, "cuda")
    h, u = gated_low_rank(e, g, a, "swiglu")
    assert torch.equal(h, swiglu(e, g))
    assert_u_within_rounding(u, h, a)
