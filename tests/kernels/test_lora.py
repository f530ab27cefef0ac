"""LoRA autograd functions (lora_o, lora_qkv, lora_mlp) against a float64 plain-autograd composition:
outputs and gradients of x, A, B; 16-bit and NF4 bases; adapters missing; rsLoRA scaling; dtypes,
autocast, and the Triton path (NF4 dequant + activation kernels under the interpreter)."""

from __future__ import annotations

import math

import pytest
import torch

from notebookkit.kernels.lora_mlp import lora_mlp, lora_mlp_reference
from notebookkit.kernels.lora_o import lora_o, lora_o_reference
from notebookkit.kernels import lora_projection
from notebookkit.kernels.lora_projection import LoRAProjection, adapter_group, projection_reference
from notebookkit.kernels.lora_qkv import lora_qkv, lora_qkv_reference
from notebookkit.kernels.nf4 import dequantize_nf4_reference
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HIDDEN, INTER, RANK, TOKENS = 123, 77, 5, 37
needs_interp = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")


# --------------------------------------------------------------------------------------------------
# Building projections: the fast one (given dtype/device) and its float64 twin (leaf A, B)
# --------------------------------------------------------------------------------------------------


class Pair:
    """A projection under test and its float64 twin with the same (dequantised) weights."""

    def __init__(self, out_f, in_f, *, nf4, adapter, dtype, device, gen, rank=RANK, rslora=False,
                 adapter_dtype=None, alpha=16.0):
        w = torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)
        if nf4:
            import bitsandbytes.functional as bnbF

            packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            w64 = dequantize_nf4_reference(packed, qs).double()
            qs.to(device)  # QuantState.to moves in place (returns None)
            weight = packed.to(device)
        else:
            w = w.to(dtype)
            w64 = w.double()
            weight, qs = w.to(device), None
        self.A = self.B = self.A64 = self.B64 = None
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        if adapter:
            adt = adapter_dtype or dtype
            a = torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)
            b = torch.randn(out_f, rank, generator=gen) * 0.05
            self.A = a.to(adt).to(device).requires_grad_()
            self.B = b.to(adt).to(device).requires_grad_()
            self.A64 = self.A.detach().double().cpu().requires_grad_()
            self.B64 = self.B.detach().double().cpu().requires_grad_()
        self.proj = LoRAProjection(weight, qs, self.A, self.B, scaling)
        self.proj64 = LoRAProjection(w64, None, self.A64, self.B64, scaling)

    def check_grads(self, dtype, what, factor=1.0):
        if self.A is None:
            return
        assert self.A.grad is not None and self.A.grad.dtype == self.A.dtype
        assert self.B.grad is not None and self.B.grad.dtype == self.B.dtype
        assert_close(self.A.grad, self.A64.grad, dtype, f"{what} dA", factor)
        assert_close(self.B.grad, self.B64.grad, dtype, f"{what} dB", factor)


def _x(dtype, device, gen, shape=(1, TOKENS, HIDDEN)):
    x = torch.randn(shape, generator=gen).to(dtype)
    return x.clone().to(device).requires_grad_(), x.double().requires_grad_()


def _backward(outs, outs64, gen):
    """Same random upstream gradient into both graphs."""
    loss = loss64 = 0
    for y, y64 in zip(outs, outs64):
        dy = torch.randn(y64.shape, generator=gen, dtype=torch.float64)
        loss = loss + (y.double() * dy.to(y.device)).sum()
        loss64 = loss64 + (y64 * dy).sum()
    loss.backward()
    loss64.backward()


# --------------------------------------------------------------------------------------------------
# lora_o
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha_r", "rslora"])
def test_lora_o(rslora, nf4, dtype, device):
    gen = torch.Generator().manual_seed(1)
    o = Pair(INTER, HIDDEN, nf4=nf4, adapter=True, dtype=dtype, device=device, gen=gen, rslora=rslora)
    x, x64 = _x(dtype, device, gen)
    y = lora_o(x, o.proj)
    y64 = lora_o_reference(x64, o.proj64)
    assert y.dtype == dtype and y.shape == (1, TOKENS, INTER)
    assert_close(y, y64, dtype, "y")
    _backward([y], [y64], gen)
    assert_close(x.grad, x64.grad, dtype, "dx")
    o.check_grads(dtype, "o")


@pytest.mark.parametrize("device", DEVICES)
def test_lora_o_without_adapter_and_without_input_grad(device):
    gen = torch.Generator().manual_seed(2)
    o = Pair(INTER, HIDDEN, nf4=True, adapter=False, dtype=torch.float32, device=device, gen=gen)
    x, x64 = _x(torch.float32, device, gen, shape=(TOKENS, HIDDEN))
    y = lora_o(x, o.proj)
    y64 = lora_o_reference(x64, o.proj64)
    _backward([y], [y64], gen)
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    # x that does not need grad: only the adapters get gradients
    o2 = Pair(INTER, HIDDEN, nf4=False, adapter=True, dtype=torch.float32, device=device, gen=gen)
    x2 = torch.randn(TOKENS, HIDDEN, generator=gen).to(device)
    lora_o(x2, o2.proj).sum().backward()
    lora_o_reference(x2.double().cpu(), o2.proj64).sum().backward()
    o2.check_grads(torch.float32, "o2")


# --------------------------------------------------------------------------------------------------
# lora_qkv
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_lora_qkv(nf4, dtype, device):
    gen = torch.Generator().manual_seed(3)
    q = Pair(INTER, HIDDEN, nf4=nf4, adapter=True, dtype=dtype, device=device, gen=gen)
    k = Pair(40, HIDDEN, nf4=nf4, adapter=True, dtype=dtype, device=device, gen=gen, rslora=True)
    v = Pair(40, HIDDEN, nf4=nf4, adapter=False, dtype=dtype, device=device, gen=gen)
    x, x64 = _x(dtype, device, gen, shape=(2, 19, HIDDEN))
    outs = lora_qkv(x, q.proj, k.proj, v.proj)
    outs64 = lora_qkv_reference(x64, q.proj64, k.proj64, v.proj64)
    for name, y, y64 in zip("QKV", outs, outs64):
        assert y.dtype == dtype and y.shape == y64.shape
        assert_close(y, y64, dtype, name)
    _backward(outs, outs64, gen)
    assert_close(x.grad, x64.grad, dtype, "dx")
    q.check_grads(dtype, "q")
    k.check_grads(dtype, "k")


# --------------------------------------------------------------------------------------------------
# lora_mlp
# --------------------------------------------------------------------------------------------------


def _mlp_case(activation, dtype, device, nf4, gen, up_adapter=True, adapter_dtype=None):
    kw = dict(nf4=nf4, dtype=dtype, device=device, gen=gen, adapter_dtype=adapter_dtype)
    gate = Pair(INTER, HIDDEN, adapter=True, **kw)
    up = Pair(INTER, HIDDEN, adapter=up_adapter, **kw)
    down = Pair(HIDDEN, INTER, adapter=True, rslora=True, **kw)
    x, x64 = _x(dtype, device, gen)
    y = lora_mlp(x, gate.proj, up.proj, down.proj, activation)
    y64 = lora_mlp_reference(x64, gate.proj64, up.proj64, down.proj64, activation)
    return (gate, up, down), x, x64, y, y64


def _check_mlp(pairs, x, x64, y, y64, dtype, gen):
    assert y.dtype == dtype and y.shape == y64.shape
    assert_close(y, y64, dtype, "y")
    _backward([y], [y64], gen)
    assert_close(x.grad, x64.grad, dtype, "dx")
    for name, p in zip(("gate", "up", "down"), pairs):
        p.check_grads(dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "geglu_tanh"])
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_lora_mlp(nf4, activation, dtype, device):
    gen = torch.Generator().manual_seed(4)
    _check_mlp(*_mlp_case(activation, dtype, device, nf4, gen, up_adapter=not nf4), dtype, gen)


@needs_interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
def test_lora_mlp_triton_path(activation, dtype):
    """NF4 dequant and activation kernels under the interpreter, inside the LoRA MLP."""
    gen = torch.Generator().manual_seed(5)
    with use_triton(True):
        pairs, x, x64, y, y64 = _mlp_case(activation, dtype, "cpu", True, gen)
        _check_mlp(pairs, x, x64, y, y64, dtype, gen)


@needs_interp
def test_lora_qkv_o_triton_path():
    gen = torch.Generator().manual_seed(6)
    dtype = torch.float16
    with use_triton(True):
        q, k, v = (Pair(n, HIDDEN, nf4=True, adapter=True, dtype=dtype, device="cpu", gen=gen) for n in (77, 40, 40))
        x, x64 = _x(dtype, "cpu", gen)
        outs = lora_qkv(x, q.proj, k.proj, v.proj)
        o = Pair(HIDDEN, 77, nf4=True, adapter=True, dtype=dtype, device="cpu", gen=gen)
        y = lora_o(outs[0], o.proj)
        y64 = lora_o_reference(lora_qkv_reference(x64, q.proj64, k.proj64, v.proj64)[0], o.proj64)
        _backward([y, outs[1], outs[2]], [y64, *lora_qkv_reference(x64, q.proj64, k.proj64, v.proj64)[1:]], gen)
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    for name, p in zip("qkvo", (q, k, v, o)):
        p.check_grads(dtype, name)


# --------------------------------------------------------------------------------------------------
# dtypes: fp32 adapters with 16-bit activations, autocast
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_adapters_with_16bit_input(dtype, device):
    gen = torch.Generator().manual_seed(7)
    pairs, x, x64, y, y64 = _mlp_case("swiglu", dtype, device, True, gen, adapter_dtype=torch.float32)
    assert pairs[0].A.dtype == torch.float32
    _check_mlp(pairs, x, x64, y, y64, dtype, gen)  # grads come back in fp32, values to the 16-bit bound


def test_autocast_cpu_bf16():
    gen = torch.Generator().manual_seed(8)
    o = Pair(INTER, HIDDEN, nf4=True, adapter=True, dtype=torch.float32, device="cpu", gen=gen)
    x, x64 = _x(torch.float32, "cpu", gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_o(x, o.proj)
    assert y.dtype == torch.bfloat16
    y64 = lora_o_reference(x64, o.proj64)
    _backward([y], [y64], gen)
    assert x.grad.dtype == torch.float32 and o.A.grad.dtype == torch.float32
    assert_close(y, y64, torch.bfloat16, "y")
    assert_close(x.grad, x64.grad, torch.bfloat16, "dx")
    o.check_grads(torch.bfloat16, "o")


# --------------------------------------------------------------------------------------------------
# Misuse
# --------------------------------------------------------------------------------------------------


def test_errors():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(INTER, HIDDEN, generator=gen)
    with pytest.raises(ValueError, match="both lora_A and lora_B"):
        LoRAProjection(w, None, torch.randn(RANK, HIDDEN), None, 1.0)
    with pytest.raises(ValueError, match="Adapter shapes"):
        LoRAProjection(w, None, torch.randn(RANK, HIDDEN + 1), torch.randn(INTER, RANK), 1.0)
    frozen_not = LoRAProjection(w.clone().requires_grad_(), None, None, None, 1.0)
    with pytest.raises(ValueError, match="frozen"):
        lora_o(torch.randn(3, HIDDEN), frozen_not)
    p = LoRAProjection(w, None, None, None, 1.0)
    with pytest.raises(ValueError, match="activation"):
        lora_mlp(torch.randn(3, HIDDEN), p, p, p, "relu")


def test_mlp_backward_runs_once():
    gen = torch.Generator().manual_seed(10)
    pairs, x, x64, y, y64 = _mlp_case("swiglu", torch.float32, "cpu", False, gen)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once|inplace|modified"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nf4,tile_rows", [(False, None), (True, None), (False, 5), (True, 16)],
                         ids=["dense", "nf4", "dense-tiles-of-5", "nf4-tiles-of-16"])
def test_mlp_without_output_has_the_same_gradients(nf4, tile_rows, dtype, device):
    """compute_output=False (a recompute pass) returns zeros; the gradients, computed a tile of tokens at a
    time in backward (38 tokens: tiles of 5 leave a last tile of 3), still match float64."""
    gen = torch.Generator().manual_seed(11)
    kw = dict(nf4=nf4, dtype=dtype, device=device, gen=gen)
    gate, up = Pair(INTER, HIDDEN, adapter=True, **kw), Pair(INTER, HIDDEN, adapter=True, **kw)
    down = Pair(HIDDEN, INTER, adapter=True, **kw)
    x, x64 = _x(dtype, device, gen, shape=(2, 19, HIDDEN))
    y = lora_mlp(x, gate.proj, up.proj, down.proj, "swiglu", compute_output=False, tile_rows=tile_rows)
    y64 = lora_mlp_reference(x64, gate.proj64, up.proj64, down.proj64, "swiglu")
    assert y.shape == y64.shape and y.dtype == dtype and not y.any()
    _backward([y], [y64], gen)
    assert_close(x.grad, x64.grad, dtype, "dx")
    for name, p in zip(("gate", "up", "down"), (gate, up, down)):
        p.check_grads(dtype, name)


class _ListParking:
    """A ParkedTiles store that keeps the tiles as they are (the checkpointing's copies them to the host)."""

    def __init__(self):
        self.tiles = []

    def put(self, e, g):
        self.tiles.append((e, g))

    def take(self):
        return self.tiles.pop(0) if self.tiles else None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nf4,tile_rows", [(False, None), (True, 5)], ids=["dense", "nf4-tiles-of-5"])
def test_mlp_parked_gate_up_give_the_recompute_bits(nf4, tile_rows, dtype, device, monkeypatch):
    """An offloaded layer's first forward (no grad) parks each tile's e, g; its recompute's deferred backward
    takes them instead of running the gate/up GEMMs, with the gradients of the deferred recompute bit for bit."""
    import notebookkit.kernels.lora_mlp as lora_mlp_module

    gen = torch.Generator().manual_seed(13)
    kw = dict(nf4=nf4, adapter=True, dtype=dtype, device=device, gen=gen)
    gate, up, down = Pair(INTER, HIDDEN, **kw), Pair(INTER, HIDDEN, **kw), Pair(HIDDEN, INTER, **kw)
    projs = (gate.proj, up.proj, down.proj)
    x, _ = _x(dtype, device, gen, shape=(2, 19, HIDDEN))
    dy = torch.randn(2, 19, HIDDEN, generator=gen).to(dtype).to(device)

    def gradients(parked):
        xi = x.detach().clone().requires_grad_()
        for p in (gate, up, down):
            p.A.grad = p.B.grad = None
        y = lora_mlp(xi, *projs, "swiglu", compute_output=False, tile_rows=tile_rows, parked=parked)
        y.backward(dy)
        return [xi.grad] + [t.grad.clone() for p in (gate, up, down) for t in (p.A, p.B)]

    recomputed = gradients(None)
    store = _ListParking()
    with torch.no_grad():
        lora_mlp(x, *projs, "swiglu", tile_rows=tile_rows, parked=store)
    assert len(store.tiles) == (1 if tile_rows is None else 8)  # 38 tokens in tiles of 5
    calls = []
    forward = lora_mlp_module.shared_input_forward
    monkeypatch.setattr(lora_mlp_module, "shared_input_forward", lambda *a: calls.append(1) or forward(*a))
    parked = gradients(store)
    assert not calls and not store.tiles  # no gate/up product in the backward; every tile taken
    for a, b in zip(parked, recomputed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tile_rows", [None, 7])
def test_mlp_forward_without_grad_in_tiles(tile_rows, dtype, device):
    """Under ``torch.no_grad`` the forward runs a tile of tokens at a time (37 tokens: tiles of 7 leave 2)
    and equals the float64 composition."""
    gen = torch.Generator().manual_seed(12)
    pairs, _, _, _, _ = _mlp_case("geglu_tanh", dtype, device, True, gen)
    x, x64 = _x(dtype, device, gen)
    with torch.no_grad():
        y = lora_mlp(x, *(p.proj for p in pairs), "geglu_tanh", tile_rows=tile_rows)
        y64 = lora_mlp_reference(x64, *(p.proj64 for p in pairs), "geglu_tanh")
    assert y.dtype == dtype and y.shape == y64.shape and y.grad_fn is None
    assert_close(y, y64, dtype, "y")


def test_mlp_tile_rows_rule():
    """The tile rule the kernel and the memory model share: 256 MiB of one intermediate, whole 256-row
    blocks, at least 4,096 rows."""
    from notebookkit.sequence_tiles import mlp_tile_rows

    assert mlp_tile_rows(14336, 2) == 9216 and mlp_tile_rows(8192, 2) == 16384 and mlp_tile_rows(14336, 4) == 4608
    assert mlp_tile_rows(10**6, 2) == 4096
    with pytest.raises(ValueError, match="intermediate_size"):
        mlp_tile_rows(0, 2)
    p = LoRAProjection(torch.randn(INTER, HIDDEN), None, None, None, 1.0)
    q = LoRAProjection(torch.randn(HIDDEN, INTER), None, None, None, 1.0)
    with pytest.raises(ValueError, match="tile_rows"):
        lora_mlp(torch.randn(3, HIDDEN), p, p, q, tile_rows=0)


class _CountCalls:
    """Counts the aten calls of the op names given (each a kernel launch) under it."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.calls = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.calls += func.overloadpacket.__name__ in counter.names
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("alpha", [float(RANK), 16.0], ids=["alpha_eq_r", "alpha_16"])
def test_the_scaling_is_the_gemms_alpha(alpha):
    """The scaling ``s`` of ``s (X A^T)`` and ``U = s (dY B)`` is the GEMMs' alpha: no multiply launch at any
    scaling, one projection or a group of one scaling; a group whose scalings differ scales each column
    block of its one ``X A_cat^T`` in the forward (three here), and the backward reads it as saved."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float32
    pair = Pair(HIDDEN, INTER, nf4=False, adapter=True, dtype=dtype, device="cpu", gen=gen, alpha=alpha)
    x, x64 = _x(dtype, "cpu", gen, shape=(1, TOKENS, INTER))
    with _CountCalls("mul_") as count:
        y = lora_o(x, pair.proj)
        _backward([y], [lora_o_reference(x64, pair.proj64)], gen)
    assert count.calls == 0
    assert_close(x.grad, x64.grad, dtype, "dx")
    pair.check_grads(dtype, "o")

    for case, multiplies in (("scaling_one", 0), ("scalings_differ", 3)):
        pairs = [Pair(o, HIDDEN, nf4=False, adapter=True, dtype=dtype, device="cpu", gen=gen, alpha=alpha)
                 for o in (INTER, 40, 40)] if case == "scaling_one" else _group_pairs(case, dtype, "cpu", gen)
        x, x64 = _x(dtype, "cpu", gen, shape=(2, 19, HIDDEN))
        with _CountCalls("mul_") as count:
            outs = lora_qkv(x, *(p.proj for p in pairs))
            _backward(outs, lora_qkv_reference(x64, *(p.proj64 for p in pairs)), gen)
        assert count.calls == multiplies, (case, count.calls)
        assert_close(x.grad, x64.grad, dtype, "dx")
        for name, p in zip("qkv", pairs):
            p.check_grads(dtype, name)


# --------------------------------------------------------------------------------------------------
# Grouped adapters: q/k/v (and gate/up) with adapters of one rank share the rank-space GEMMs
# --------------------------------------------------------------------------------------------------

GROUP_CASES = {
    # name: (ranks, alphas, rslora, adapters, grouped)
    "scalings_differ": ((RANK,) * 3, (16.0, float(RANK), 3.0), (False, True, False), (True,) * 3, True),
    "scaling_one": ((RANK,) * 3, (float(RANK),) * 3, (False,) * 3, (True,) * 3, True),
    "k_without_adapter": ((RANK,) * 3, (16.0, 16.0, 8.0), (False,) * 3, (True, False, True), False),
    "ranks_differ": ((RANK, 3, RANK), (16.0, 16.0, 8.0), (False,) * 3, (True,) * 3, False),
}


def _group_pairs(case, dtype, device, gen, nf4=False, outs=(INTER, 40, 40)):
    ranks, alphas, rslora, adapters, _ = GROUP_CASES[case]
    return [Pair(o, HIDDEN, nf4=nf4, adapter=a, dtype=dtype, device=device, gen=gen, rank=r, alpha=al, rslora=rs)
            for o, r, al, rs, a in zip(outs, ranks, alphas, rslora, adapters)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_lora_qkv_grouped_and_fallback(case, nf4, dtype, device):
    gen = torch.Generator().manual_seed(12)
    pairs = _group_pairs(case, dtype, device, gen, nf4)
    projs = tuple(p.proj for p in pairs)
    assert (adapter_group(projs, dtype) is not None) == GROUP_CASES[case][-1]
    x, x64 = _x(dtype, device, gen, shape=(2, 19, HIDDEN))
    outs = lora_qkv(x, *projs)
    outs64 = lora_qkv_reference(x64, *(p.proj64 for p in pairs))
    for name, y, y64 in zip("QKV", outs, outs64):
        assert y.dtype == dtype and y.shape == y64.shape
        assert_close(y, y64, dtype, name)
    _backward(outs, outs64, gen)
    assert_close(x.grad, x64.grad, dtype, "dx")
    for name, p in zip("qkv", pairs):
        p.check_grads(dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_lora_mlp_grouped_and_fallback(case, dtype, device):
    """gate and up take the first two situations of the case (down is never grouped)."""
    gen = torch.Generator().manual_seed(13)
    gate, up, _ = _group_pairs(case, dtype, device, gen, outs=(INTER, INTER, INTER))
    down = Pair(HIDDEN, INTER, nf4=False, adapter=True, dtype=dtype, device=device, gen=gen, alpha=3.0)
    ranks, _, _, adapters, _ = GROUP_CASES[case]
    assert (adapter_group((gate.proj, up.proj), dtype) is not None) == (all(adapters[:2]) and ranks[0] == ranks[1])
    x, x64 = _x(dtype, device, gen)
    y = lora_mlp(x, gate.proj, up.proj, down.proj, "swiglu")
    y64 = lora_mlp_reference(x64, gate.proj64, up.proj64, down.proj64, "swiglu")
    _check_mlp((gate, up, down), x, x64, y, y64, dtype, gen)


@needs_interp
@pytest.mark.parametrize("case", ["scalings_differ", "ranks_differ"])
def test_lora_mlp_grouped_triton_path(case):
    """NF4 dequant and the activation kernels under the interpreter, with grouped gate/up (fp16)."""
    gen = torch.Generator().manual_seed(14)
    dtype = torch.float16
    with use_triton(True):
        gate, up, _ = _group_pairs(case, dtype, "cpu", gen, nf4=True, outs=(INTER, INTER, INTER))
        down = Pair(HIDDEN, INTER, nf4=True, adapter=True, dtype=dtype, device="cpu", gen=gen)
        x, x64 = _x(dtype, "cpu", gen)
        y = lora_mlp(x, gate.proj, up.proj, down.proj, "geglu_tanh")
        y64 = lora_mlp_reference(x64, gate.proj64, up.proj64, down.proj64, "geglu_tanh")
        _check_mlp((gate, up, down), x, x64, y, y64, dtype, gen)


def _without_grouping(monkeypatch):
    """The shared-input dispatch (q/k/v and gate/up alike) runs every projection on its own."""
    monkeypatch.setattr(lora_projection, "adapter_group", lambda projs, dtype: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_grouped_matches_the_per_projection_path(dtype, monkeypatch):
    """The grouped GEMMs give what one GEMM per projection gives: fp32 to a few ulps (other GEMM
    blockings), fp16 to the 16-bit bound (dX sums U_cat A_cat in one GEMM, before: three roundings)."""
    def run():
        gen = torch.Generator().manual_seed(15)
        pairs = _group_pairs("scalings_differ", dtype, "cpu", gen)
        mlp = [Pair(o, i, nf4=False, adapter=True, dtype=dtype, device="cpu", gen=gen, alpha=a)
               for o, i, a in ((INTER, HIDDEN, 16.0), (INTER, HIDDEN, 2.5), (HIDDEN, INTER, 16.0))]
        x, _ = _x(dtype, "cpu", gen, shape=(2, 19, HIDDEN))
        outs = [*lora_qkv(x, *(p.proj for p in pairs)), lora_mlp(x, *(p.proj for p in mlp), "swiglu")]
        torch.autograd.backward(outs, [torch.randn(y.shape, generator=gen).to(dtype) for y in outs])
        return [*outs, x.grad] + [t.grad for p in pairs + mlp for t in (p.A, p.B)]

    grouped = run()
    with monkeypatch.context() as m:
        _without_grouping(m)
        per_projection = run()
    bound = 1e-6 if dtype == torch.float32 else None
    for i, (a, b) in enumerate(zip(grouped, per_projection)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if bound is None:
            assert_close(a, b, dtype, f"tensor {i}")
        else:
            assert rel_err(a, b) <= bound, (i, rel_err(a, b))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_projection"])
def test_lora_qkv_skips_the_gradients_nobody_needs(grouped):
    """x without grad, q's B and v's A frozen: those get no gradient, the others match float64."""
    gen = torch.Generator().manual_seed(16)
    dtype = torch.float32
    pairs = _group_pairs("scalings_differ" if grouped else "k_without_adapter", dtype, "cpu", gen)
    q, k, v = pairs
    for t in (q.B, q.B64, v.A, v.A64):
        t.requires_grad_(False)
    x = torch.randn(2, 19, HIDDEN, generator=gen)
    outs = lora_qkv(x, *(p.proj for p in pairs))
    outs64 = lora_qkv_reference(x.double(), *(p.proj64 for p in pairs))
    _backward(outs, outs64, gen)
    assert x.grad is None and q.B.grad is None and v.A.grad is None
    assert_close(q.A.grad, q.A64.grad, dtype, "q dA")
    assert_close(v.B.grad, v.B64.grad, dtype, "v dB")
    if k.A is not None:
        k.check_grads(dtype, "k")


class _CountOps:
    """Counts aten GEMM calls (mm, addmm, addmm_, matmul, bmm) and torch.cat calls under it."""

    GEMMS = ("mm", "addmm", "addmm_", "matmul", "bmm")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.gemms = self.cats = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                counter.gemms += name in _CountOps.GEMMS
                counter.cats += name == "cat"
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("case,qkv_gemms,mlp_gemms", [("scalings_differ", 18, 22), ("ranks_differ", 24, 25)],
                         ids=["grouped", "one_at_a_time"])
def test_gemm_calls_per_layer_forward_and_backward(case, qkv_gemms, mlp_gemms):
    """One forward + backward with adapters on all projections (dense base, all gradients needed).

    One projection at a time (ranks that differ): 8 GEMMs each (X W^T, s X A^T, addmm_ of the low-rank
    part; in backward U, dA, dB from the saved s X A^T, dY W, addmm_ of U A), 24 for q/k/v; the MLP 25,
    its down projection computing s h A^T again from the h its backward rebuilds. Grouped: lora_qkv 18
    (the three X A^T are one GEMM, the three U A one addmm_, the three dA one GEMM), lora_mlp 22 (gate and
    up share 3 GEMMs). lora_o is the one-projection case of the same dispatch: 8. A backward that computed
    X A^T again would add one GEMM a group or projection.
    """
    gen = torch.Generator().manual_seed(17)
    dtype = torch.float32
    q, k, v = _group_pairs(case, dtype, "cpu", gen)
    x, _ = _x(dtype, "cpu", gen)
    with _CountOps() as count:
        outs = lora_qkv(x, q.proj, k.proj, v.proj)
        torch.autograd.backward(outs, [torch.ones_like(y) for y in outs])
    assert count.gemms == qkv_gemms, count.gemms

    gate, up, _ = _group_pairs(case, dtype, "cpu", gen, outs=(INTER, INTER, INTER))
    down = Pair(HIDDEN, INTER, nf4=False, adapter=True, dtype=dtype, device="cpu", gen=gen)
    with _CountOps() as count:
        lora_mlp(x, gate.proj, up.proj, down.proj, "swiglu").sum().backward()
    assert count.gemms == mlp_gemms, count.gemms

    with _CountOps() as count:
        lora_o(x, q.proj).sum().backward()
    assert count.gemms == 8, count.gemms


@pytest.mark.parametrize("adapter_dtype", [torch.float16, torch.float32], ids=["same_dtype", "fp32_adapters"])
def test_a_cat_built_once_and_rebuilt_after_an_update(adapter_dtype):
    """The forward and the backward share one A_cat (one torch.cat); a later call with unchanged
    adapters builds none; after an in-place update of one A (an optimizer step) the next call builds
    it again and follows the new value."""
    gen = torch.Generator().manual_seed(18)
    dtype = torch.float16
    outs_f = (INTER, 40, 40)
    pairs = [Pair(o, HIDDEN, nf4=False, adapter=True, dtype=dtype, device="cpu", gen=gen, alpha=a,
                  adapter_dtype=adapter_dtype) for o, a in zip(outs_f, (16.0, 8.0, 4.0))]
    projs = tuple(p.proj for p in pairs)

    def step(expect_cats):
        for p in pairs:
            p.A.grad = p.B.grad = p.A64.grad = p.B64.grad = None
        x, x64 = _x(dtype, "cpu", gen)
        with _CountOps() as count:
            outs = lora_qkv(x, *projs)
            outs64 = lora_qkv_reference(x64, *(p.proj64 for p in pairs))
            _backward(outs, outs64, gen)
        assert count.cats == expect_cats, count.cats
        for name, y, y64 in zip("QKV", outs, outs64):
            assert_close(y, y64, dtype, name)
        assert_close(x.grad, x64.grad, dtype, "dx")
        for name, p in zip("qkv", pairs):
            p.check_grads(dtype, name)

    step(expect_cats=1)
    step(expect_cats=0)
    with torch.no_grad():
        pairs[1].A.mul_(2.0)
        pairs[1].A64.mul_(2.0)
    step(expect_cats=1)


def _biases(dtype, device, gen, widths=(INTER, INTER, HIDDEN), present=(True, True, True)):
    """Frozen biases of gate, up and down (a vision tower's MLP), and their float64 twins."""
    made = [torch.randn(w, generator=gen).to(dtype) if p else None for w, p in zip(widths, present)]
    return (tuple(None if b is None else b.to(device) for b in made),
            tuple(None if b is None else b.double() for b in made))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nf4,present", [(False, (True, True, True)), (True, (True, False, True))],
                         ids=["dense-all", "nf4-no-up-bias"])
@pytest.mark.parametrize("deferred", [False, True], ids=["forward", "deferred-tiles-of-5"])
def test_lora_mlp_with_frozen_biases(deferred, nf4, present, dtype, device):
    """Frozen biases (Qwen2.5-VL's vision MLPs) join e, g and Y; the gradients of x and the adapters match
    float64, after a forward with autograd and after a deferred recompute (compute_output=False, tiles of 5:
    its backward computes e, g again, biases included), and a forward without autograd in tiles gives Y."""
    gen = torch.Generator().manual_seed(17)
    kw = dict(nf4=nf4, adapter=True, dtype=dtype, device=device, gen=gen)
    pairs = Pair(INTER, HIDDEN, **kw), Pair(INTER, HIDDEN, **kw), Pair(HIDDEN, INTER, **kw)
    biases, biases64 = _biases(dtype, device, gen, present=present)
    x, x64 = _x(dtype, device, gen, shape=(2, 19, HIDDEN))
    y64 = lora_mlp_reference(x64, *(p.proj64 for p in pairs), "swiglu", biases=biases64)
    with torch.no_grad():
        assert_close(lora_mlp(x, *(p.proj for p in pairs), "swiglu", tile_rows=5, biases=biases), y64, dtype, "y")
    y = lora_mlp(x, *(p.proj for p in pairs), "swiglu", compute_output=not deferred, tile_rows=5, biases=biases)
    if not deferred:
        assert_close(y, y64, dtype, "y")
    _backward([y], [y64], gen)
    assert_close(x.grad, x64.grad, dtype, "dx")
    for name, p in zip(("gate", "up", "down"), pairs):
        p.check_grads(dtype, name)


@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_frozen_biases_are_added_by_the_base_gemms(nf4):
    """A vision tower's biased linears: the bias is the base GEMM's added input (``addmm``), not an ``add`` launch
    of its own, in ``lora_mlp`` (gate, up, down) and ``shared_input_lora`` (one or several projections): their
    forwards make as many ``add`` calls with biases as without (none on a dense base; the CPU's NF4 decode makes
    some of its own); the outputs and gradients match float64."""
    from notebookkit.kernels.lora_projection import shared_input_lora

    gen = torch.Generator().manual_seed(19)
    dtype = torch.float32
    kw = dict(nf4=nf4, adapter=True, dtype=dtype, device="cpu", gen=gen)
    mlp = Pair(INTER, HIDDEN, **kw), Pair(INTER, HIDDEN, **kw), Pair(HIDDEN, INTER, **kw)
    biases, biases64 = _biases(dtype, "cpu", gen)
    x, x64 = _x(dtype, "cpu", gen, shape=(2, 19, HIDDEN))
    with torch.no_grad(), _CountCalls("add", "add_") as unbiased:
        lora_mlp(x, *(p.proj for p in mlp), "swiglu")
    with _CountCalls("add", "add_") as count:
        y = lora_mlp(x, *(p.proj for p in mlp), "swiglu", biases=biases)
    assert count.calls == unbiased.calls == (3 if nf4 else 0)
    y64 = lora_mlp_reference(x64, *(p.proj64 for p in mlp), "swiglu", biases=biases64)
    assert_close(y, y64, dtype, "mlp y")

    qkv = [Pair(o, HIDDEN, **kw) for o in (INTER, 40, 40)]
    b = [torch.randn(o, generator=gen) for o in (INTER, 40, 40)]
    with torch.no_grad(), _CountCalls("add", "add_") as unbiased:
        shared_input_lora(x, [p.proj for p in qkv])
    with _CountCalls("add", "add_") as count:
        outs = shared_input_lora(x, [p.proj for p in qkv], (b[0], None, b[2]))
    assert count.calls == unbiased.calls == (3 if nf4 else 0)
    outs64 = [projection_reference(x64, p.proj64) + (0 if bias is None else bias.double())
              for p, bias in zip(qkv, (b[0], None, b[2]))]
    for name, out, out64 in zip("qkv", outs, outs64):
        assert_close(out, out64, dtype, name)
    _backward([y, *outs], [y64, *outs64], gen)
    assert_close(x.grad, x64.grad, dtype, "dx")
    for name, p in zip(("gate", "up", "down", "q", "k", "v"), (*mlp, *qkv)):
        p.check_grads(dtype, name)
    with pytest.raises(ValueError, match="requires grad"):
        shared_input_lora(x, [qkv[0].proj], (torch.zeros(INTER, requires_grad=True),))


def test_lora_mlp_refuses_a_trainable_or_misshapen_bias():
    gen = torch.Generator().manual_seed(18)
    kw = dict(nf4=False, adapter=True, dtype=torch.float32, device="cpu", gen=gen)
    gate, up, down = Pair(INTER, HIDDEN, **kw), Pair(INTER, HIDDEN, **kw), Pair(HIDDEN, INTER, **kw)
    x = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match="requires grad"):
        lora_mlp(x, gate.proj, up.proj, down.proj, biases=(torch.zeros(INTER, requires_grad=True), None, None))
    with pytest.raises(ValueError, match="expected"):
        lora_mlp(x, gate.proj, up.proj, down.proj, biases=(None, None, torch.zeros(INTER)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_an_fp32_adapters_gradient_keeps_the_fp32_sum(device, dtype, monkeypatch):
    """``product_in``: 16-bit operands, an fp32 adapter. On CUDA one GEMM writes the fp32 sum (``torch.mm``'s
    ``out_dtype``), closer to the float64 product than the 16-bit product cast up (its rounding error, one unit of
    16-bit a element, is gone); on the CPU, and where a card refuses it, the product then the cast, as before."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(16, 777, generator=g).to(dtype).to(device)
    b = torch.randn(777, 24, generator=g).to(dtype).to(device)
    exact = a.double() @ b.double()
    got = lora_projection.product_in(a, b, torch.float32)
    cast = (a @ b).to(torch.float32)
    assert got.dtype == torch.float32
    if device == "cpu":
        assert torch.equal(got, cast)
        return
    assert lora_projection._FP32_OUT["available"], "this torch has no mm out_dtype on CUDA"
    err, err_cast = (got.double() - exact).abs().max(), (cast.double() - exact).abs().max()
    assert err < 0.25 * err_cast, (float(err), float(err_cast))

    def refuse(*args, **kwargs):
        raise RuntimeError("not on this card")

    monkeypatch.setitem(lora_projection._FP32_OUT, "available", True)
    monkeypatch.setattr(torch, "mm", refuse)
    assert torch.equal(lora_projection.product_in(a, b, torch.float32), cast)  # fell back to the product and cast
    assert not lora_projection._FP32_OUT["available"]
