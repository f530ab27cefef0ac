"""NF4 matrix-vector product (``notebookkit.kernels.nf4_matvec``): the kernel under the interpreter
(CPU) and on CUDA against float64 products of the NF4 weight decoded by its definition
(``tests/nf4_format.py``), the fallbacks, the launcher's choices, inputs and errors.

The bound every output element is held to (``assert_within_rounding``). With ``c`` the dtype of x
and ``u`` its unit roundoff (2^-8 bf16, 2^-11 fp16, 2^-24 fp32), the kernel computes
``y = c(s)``, ``s`` the fp32 sum of the ``K`` products ``x[k] * w[k]`` and the bias, ``w`` the NF4
weight decoded to ``c``. Each bf16 / fp16 product is exact in fp32 (at most 22 significant bits), so
whatever the order of the additions, ``|s - ref| <= g * S`` with ``g = (K + 1) 2^-24 / (1 - (K + 1)
2^-24)`` and ``S = sum_k |x[k] w[k]| + |b|`` (the classic bound for a sum of K + 1 terms; fp32
products add one rounding each, inside the same bound with K + 1 -> 2K + 1). The final rounding
adds at most ``u |s|``. So ``|y - ref| <= u (|ref| + g S) + g S`` plus the smallest subnormal of
``c``: a proof, not a measured floor, so no CPU and no GPU can fail it by luck, and a wrong nibble,
scale or row (an error of the size of a product term, ``|y|`` / sqrt(K) or more) breaks it.
The row kernel (one row of ``x``) does not round ``w`` to ``c``: it sums ``NF4[code] * x`` over a block in
fp32 and multiplies the sum by the block's scale, so its oracle decodes ``w`` in fp32 (``exact_w``) and the
bound counts ``3K + 1`` fp32 roundings (the products, the block sums and scales, the oracle's own ``w``).
bitsandbytes' CPU ``dequantize_4bit`` is never an oracle (wrong on AVX-512 CPUs); bitsandbytes'
CPU quantiser packs the weights (``test_nf4.py`` proves those bytes are valid NF4).
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbF  # noqa: E402

from notebookkit.kernels.nf4_matvec import (  # noqa: E402
    MAX_GROUP,
    MAX_ROWS,
    LoRATerm,
    MatvecConfig,
    ROWS_IN_THREAD_CONFIG,
    matvec_config,
    nf4_matvec,
    nf4_matvec_group,
    nf4_matvec_reference,
    nf4_matvec_supported,
)
from notebookkit.kernels.runtime import interpreter_on, use_triton  # noqa: E402
from notebookkit.kernels.testing import TOLERANCE, rel_err  # noqa: E402
from tests.kernel_launches import spy_launches  # noqa: E402
from tests.nf4_format import decode_nf4_by_definition  # noqa: E402

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _nf4_weight(n, k, dtype, nested, seed=0, blocksize=64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device)
    return bnbF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


def _inputs(m, n, k, dtype, with_bias, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype).to(device) if with_bias else None
    return x, bias


def _oracle(x, packed, qs, bias, lora=None, exact_w=False):
    """(float64 reference, S = sum |x w| + |b| + |s| sum |u B|) with w decoded by the NF4 definition in
    x's dtype (in fp32 with ``exact_w``: the row kernel's weights are never rounded to x's dtype)."""
    w = decode_nf4_by_definition(packed, qs, out_dtype=torch.float32 if exact_w else x.dtype).double().to(x.device)
    x64 = x.double().reshape(-1, w.shape[1])
    ref, size = x64 @ w.t(), x64.abs() @ w.abs().t()
    if bias is not None:
        ref, size = ref + bias.double(), size + bias.double().abs()
    if lora is not None:
        u, b, scaling = lora
        u64 = u.double().reshape(-1, u.shape[-1])
        ref = ref + scaling * (u64 @ b.double().t())
        size = size + abs(scaling) * (u64.abs() @ b.double().abs().t())
    return ref, size


def assert_within_rounding(y, x, packed, qs, bias, what="", lora=None, exact_w=False):
    """Every element within the rounding bound of the module docstring (a LoRA term's ``r`` products,
    each scaled by ``s`` with one more rounding, count as ``2 r`` more terms)."""
    assert y.dtype == x.dtype
    y64 = y.double().reshape(-1, y.shape[-1])
    assert torch.isfinite(y64).all(), f"{what}: NaN/Inf in the output (elements not written?)"
    ref, size = _oracle(x, packed, qs, bias, lora, exact_w)
    k = x.shape[-1]
    terms = 2 * k + 1 if x.dtype == torch.float32 else k + 1
    if exact_w:
        terms = 3 * k + 1
    if lora is not None:
        terms += 2 * lora[1].shape[1]
    g = terms * 2.0**-24 / (1 - terms * 2.0**-24)
    u = UNIT_ROUNDOFF[x.dtype]
    bound = u * (ref.abs() + g * size) + g * size + torch.finfo(x.dtype).tiny
    excess = (y64 - ref).abs() - bound
    assert (excess <= 0).all(), (
        f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements beyond the rounding bound; "
        f"worst |y - ref| = {float((y64 - ref).abs().max()):.3e} "
        f"(bound there {float(bound.flatten()[excess.argmax()]):.3e})"
    )


def _kernel(x, packed, qs, bias=None, config=None, lora=None):
    with use_triton(True):
        return nf4_matvec(x, (packed, qs), bias=bias, config=config, lora=lora)


def _lora_term(m, n, rank, dtype, seed=7, device="cpu", group=3, scaling=0.5):
    """A LoRA term whose ``U`` is the middle ``rank`` columns of a ``[m, group * rank]`` matrix (the
    ``X A_cat^T`` of a group of projections: rows ``group * rank`` apart)."""
    g = torch.Generator().manual_seed(seed)
    u_cat = torch.randn(m, group * rank, generator=g).to(dtype).to(device)
    b = (torch.randn(n, rank, generator=g) * 0.2).to(dtype).to(device)
    return LoRATerm(u_cat[:, rank:2 * rank], b, scaling)


# --------------------------------------------------------------------------------------------------
# CPU: the kernel under the interpreter
# --------------------------------------------------------------------------------------------------

# (N, K): odd N and 5 blocks a row (masked tiles), and even tiles (no masks).
SHAPES = [(37, 320), (96, 256)]
# tl.dot on bf16 is garbage under the interpreter (triton 3.9): bf16 only where M == 1 (no tl.dot).
M_DTYPES = [(1, torch.float32), (1, torch.float16), (1, torch.bfloat16), (3, torch.float32), (8, torch.float16),
            (16, torch.float16)]
VARIANTS = [(True, True), (False, False)]  # (nested absmax, bias)


@needs_interpreter
@pytest.mark.parametrize("nested,with_bias", VARIANTS, ids=["nested+bias", "plain"])
@pytest.mark.parametrize("m,dtype", M_DTYPES, ids=[f"M{m}-{str(d)[6:]}" for m, d in M_DTYPES])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_kernel_matches_the_definition(shape, m, dtype, nested, with_bias):
    n, k = shape
    packed, qs = _nf4_weight(n, k, dtype, nested)
    x, bias = _inputs(m, n, k, dtype, with_bias)
    assert nf4_matvec_supported(x, (packed, qs)) is False  # CPU tensors: the reference path
    with use_triton(True):
        assert nf4_matvec_supported(x, (packed, qs))
    y = _kernel(x, packed, qs, bias)
    assert y.shape == (m, n)
    assert_within_rounding(y, x, packed, qs, bias, f"kernel {shape} M={m} {dtype}", exact_w=m == 1)
    if m > 1:  # the tl.dot kernel against the reference path: both round fp32 sums of the same products
        # (w in x's dtype) that differ by accumulation order only, so an element is at most one ulp off
        ref = nf4_matvec_reference(x, (packed, qs), bias)
        assert rel_err(y, ref) <= 2 * UNIT_ROUNDOFF[dtype] + TOLERANCE[torch.float32]


@needs_interpreter
@pytest.mark.parametrize("nested,with_bias", [(False, True), (True, False)], ids=["plain+bias", "nested"])
def test_other_variants(nested, with_bias):
    packed, qs = _nf4_weight(129, 192, torch.float16, nested, seed=3)
    for m in (1, 8):
        x, bias = _inputs(m, 129, 192, torch.float16, with_bias, seed=4)
        assert_within_rounding(_kernel(x, packed, qs, bias), x, packed, qs, bias, f"M={m}", exact_w=m == 1)


# the LoRA term in the kernel's sum: fused multiply-adds and tl.dot (fp16, fp32; bf16 at M = 1 only), ranks
# below and at 16 and one that is not a power of two, U a column slice of a wider matrix
LORA_CASES = [(1, torch.bfloat16, 16), (1, torch.float16, 6), (5, torch.float16, 4), (3, torch.float32, 16)]


@needs_interpreter
@pytest.mark.parametrize("m,dtype,rank", LORA_CASES, ids=[f"M{m}-{str(d)[6:]}-r{r}" for m, d, r in LORA_CASES])
def test_lora_term_joins_the_sum(m, dtype, rank):
    n, k = 37, 320
    packed, qs = _nf4_weight(n, k, dtype, nested=True, seed=11)
    x, bias = _inputs(m, n, k, dtype, with_bias=(m == 1), seed=12)
    lora = _lora_term(m, n, rank, dtype)
    y = _kernel(x, packed, qs, bias, lora=lora)
    assert_within_rounding(y, x, packed, qs, bias, f"M={m} r={rank}", lora=lora, exact_w=m == 1)
    if m > 1:
        ref = nf4_matvec_reference(x, (packed, qs), bias, lora=lora)
        assert rel_err(y, ref) <= 2 * UNIT_ROUNDOFF[dtype] + TOLERANCE[torch.float32]
    # the term is really there: without it the output leaves the bound
    with pytest.raises(AssertionError, match="beyond the rounding bound"):
        assert_within_rounding(_kernel(x, packed, qs, bias), x, packed, qs, bias, lora=lora, exact_w=m == 1)


@needs_interpreter
def test_split_along_k_adds_the_bias_and_the_lora_term_once():
    """Split along K, the first split's sum carries the bias and the LoRA term and the second launch adds the splits:
    the same function as one program a row block (five rows of x, three of the four splits with steps, one empty)."""
    n, k, m = 37, 320, 5
    packed, qs = _nf4_weight(n, k, torch.float16, nested=True, seed=13)
    x, bias = _inputs(m, n, k, torch.float16, with_bias=True, seed=14)
    lora = _lora_term(m, n, 4, torch.float16)
    config = MatvecConfig(block_n=16, step_blocks=1, use_dot=True, num_warps=1, split_k=4)
    y = _kernel(x, packed, qs, bias, config, lora)
    assert_within_rounding(y, x, packed, qs, bias, "split 4", lora=lora, exact_w=False)
    ref = nf4_matvec_reference(x, (packed, qs), bias, lora=lora)
    assert rel_err(y, ref) <= 2 * UNIT_ROUNDOFF[torch.float16] + TOLERANCE[torch.float32]


def _group(ns, k, dtype, nested, with_bias, with_lora, seed=21, device="cpu", rank=8):
    """Weights ``[n_i, k]`` that read one ``x [1, k]``, their biases and LoRA terms (``U_i`` the columns of one
    ``X A_cat^T``, as a decode layer's q/k/v)."""
    weights = [_nf4_weight(n, k, dtype, nested, seed=seed + i, device=device) for i, n in enumerate(ns)]
    x, _ = _inputs(1, 1, k, dtype, False, seed=seed, device=device)
    biases = [_inputs(1, n, k, dtype, True, seed=seed + 10 + i, device=device)[1] if with_bias else None
              for i, n in enumerate(ns)]
    g = torch.Generator().manual_seed(seed)
    u_cat = torch.randn(1, len(ns) * rank, generator=g).to(dtype).to(device)
    loras = [LoRATerm(u_cat[:, i * rank:(i + 1) * rank], (torch.randn(n, rank, generator=g) * 0.2).to(dtype).to(device),
                      0.5 + i) if with_lora else None for i, n in enumerate(ns)]
    return x, weights, biases, loras


# (row counts of the weights, dtype, nested absmax, bias, LoRA): q/k/v-like triples and gate/up-like pairs, row
# counts that do not divide into the programs' rows (masked), bf16 too (the row kernel has no tl.dot)
GROUP_CASES = [((37, 16, 21), torch.float16, True, True, True), ((40, 40), torch.bfloat16, False, True, False),
               ((8, 29, 13), torch.float32, False, False, True), ((33, 64), torch.float16, True, False, False)]
GROUP_CONFIGS = [None, MatvecConfig(block_n=4, step_blocks=2, use_dot=False, num_warps=2),
                 MatvecConfig(block_n=2, step_blocks=1, use_dot=False, prefetch=True),
                 MatvecConfig(block_n=4, step_blocks=4, use_dot=False, rows_in_thread=True)]


@needs_interpreter
@pytest.mark.parametrize("config", GROUP_CONFIGS, ids=lambda c: "auto" if c is None else _config_id(c))
@pytest.mark.parametrize("ns,dtype,nested,with_bias,with_lora", GROUP_CASES,
                         ids=[f"{len(c[0])}w-{str(c[1])[6:]}" for c in GROUP_CASES])
def test_group_is_each_weight_alone_bit_for_bit(ns, dtype, nested, with_bias, with_lora, config):
    """One launch for two or three weights: each output the bits of ``nf4_matvec`` on that weight alone at
    the same tiling (and so inside the rounding bound of its definition)."""
    k = 320
    x, weights, biases, loras = _group(ns, k, dtype, nested, with_bias, with_lora)
    with use_triton(True):
        ys = nf4_matvec_group(x, weights, biases, loras=loras, config=config)
        tiling = config or matvec_config(1, sum(ns), k)
        alone = [nf4_matvec(x, w, b, lora=lo, config=tiling) for w, b, lo in zip(weights, biases, loras)]
    assert [tuple(y.shape) for y in ys] == [(1, n) for n in ns]
    for i, (y, y_alone) in enumerate(zip(ys, alone)):
        assert torch.equal(y, y_alone), f"weight {i} of {len(ns)}: not the one-weight kernel's bits"
        assert_within_rounding(y, x, *weights[i], biases[i], f"weight {i}", lora=loras[i], exact_w=True)


@needs_interpreter
def test_group_takes_one_launch_or_one_call_a_weight(monkeypatch):
    """One kernel launch for up to MAX_GROUP weights (of four weights, the first three); one ``nf4_matvec`` a weight
    where one launch cannot take them all (rows of x, mixed absmax kinds, a bias on some), with its outputs."""
    import notebookkit.kernels.nf4_matvec as module

    launches = spy_launches(monkeypatch, module, "_nf4_matvec_rows_group_kernel")
    k = 192
    x, weights, biases, loras = _group((24, 8, 8, 16), k, torch.float16, True, True, True, seed=31)
    with use_triton(True):
        ys = nf4_matvec_group(x, weights, biases, loras=loras)
        # weights 0-2 in one launch, each its own programs; the fourth alone runs the one-weight kernel
        rows = matvec_config(1, 24 + 8 + 8, k).block_n
        assert MAX_GROUP == 3 and [grid for _, grid, _ in launches] == [(-(-24 // rows) + 2 * -(-8 // rows),)]
        for y, w, b, lo in zip(ys, weights, biases, loras):
            assert_within_rounding(y, x, *w, b, "four weights", lora=lo, exact_w=True)
        plain = _nf4_weight(8, k, torch.float16, nested=False, seed=5)
        rows3 = _inputs(3, 1, k, torch.float16, False, seed=6)[0]
        for what, args, kwargs in (
                ("rows of x", (rows3, weights[:2]), {}),
                ("absmax kinds", (x, [weights[0], plain]), {}),
                ("a bias on one", (x, weights[:2], [biases[0], None]), {})):
            launches.clear()
            ys = nf4_matvec_group(*args, **kwargs)
            assert not launches, what
            biases_of = args[2] if len(args) > 2 else [None] * len(args[1])
            for y, w, b in zip(ys, args[1], biases_of):
                assert torch.equal(y, nf4_matvec(args[0], w, b)), what
    with pytest.raises(ValueError, match="2 weights, but 1 biases"):
        nf4_matvec_group(x, weights[:2], [None])


def test_lora_term_shapes_are_checked():
    packed, qs = _nf4_weight(16, 128, torch.float16, nested=False)
    x, _ = _inputs(2, 16, 128, torch.float16, False)
    u, b, _ = _lora_term(2, 16, 4, torch.float16)
    with pytest.raises(ValueError, match=r"U \[2, r\] and B \[16, r\]"):
        nf4_matvec(x, (packed, qs), lora=LoRATerm(u, b[:8], 1.0))
    with pytest.raises(ValueError, match="must be torch.float16"):
        nf4_matvec(x, (packed, qs), lora=LoRATerm(u.float(), b, 1.0))
    # the CPU path (decode, then multiply) adds the term too
    y = nf4_matvec(x, (packed, qs), lora=LoRATerm(u, b, 2.0))
    assert_within_rounding(y, x, packed, qs, None, "cpu path", lora=LoRATerm(u, b, 2.0))


CONFIGS = [
    MatvecConfig(block_n=4, step_blocks=2, use_dot=False, num_warps=2),  # 5 blocks a row: a partial last step
    MatvecConfig(block_n=16, step_blocks=8, use_dot=False),  # a step wider than the row
    MatvecConfig(block_n=4, step_blocks=2, use_dot=False, prefetch=True),  # the next tile a step ahead, masked
    MatvecConfig(block_n=2, step_blocks=1, use_dot=False, prefetch=True),  # one block a step: 4 or 5 steps
    MatvecConfig(block_n=4, step_blocks=2, use_dot=False, num_warps=2, rows_in_thread=True),  # masked rows, steps
    MatvecConfig(block_n=4, step_blocks=8, use_dot=False, rows_in_thread=True),  # a step wider than the row
    MatvecConfig(block_n=16, step_blocks=1, use_dot=True, num_warps=1),
    MatvecConfig(block_n=32, step_blocks=2, use_dot=True, num_warps=2),
    MatvecConfig(block_n=64, step_blocks=4, use_dot=True),
    MatvecConfig(block_n=16, step_blocks=1, use_dot=True, num_warps=1, split_k=4),  # 5 or 4 steps: a split left empty
    MatvecConfig(block_n=32, step_blocks=2, use_dot=True, num_warps=2, split_k=2),  # a partial last step in a split
]


def _config_id(c: MatvecConfig) -> str:
    return (f"n{c.block_n}-s{c.step_blocks}-{'dot' if c.use_dot else 'fma'}-w{c.num_warps}" + ("-prefetch" * c.prefetch)
            + ("-rows-in-thread" * c.rows_in_thread) + (f"-split{c.split_k}" if c.split_k > 1 else ""))


@needs_interpreter
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_launch_configs(config):
    """Every tiling gives the same function: rows and steps that do not divide N and K (masked) and
    ones that do, fused multiply-adds (one row of x) and tl.dot (here with one row too)."""
    for n, k in ((37, 320), (64, 256)):
        packed, qs = _nf4_weight(n, k, torch.float16, nested=True, seed=n)
        x, bias = _inputs(1, n, k, torch.float16, True, seed=k)
        y = _kernel(x, packed, qs, bias, config)
        assert_within_rounding(y, x, packed, qs, bias, f"{config} {n}x{k}", exact_w=not config.use_dot)


@needs_interpreter
@pytest.mark.parametrize("blocksize", [32, 128, 256])
def test_other_blocksizes(blocksize):
    packed, qs = _nf4_weight(33, 2 * blocksize * 3, torch.float16, nested=True, blocksize=blocksize, seed=5)
    for m in (1, 5):
        x, bias = _inputs(m, 33, 2 * blocksize * 3, torch.float16, True, seed=6)
        assert_within_rounding(_kernel(x, packed, qs, bias), x, packed, qs, bias, f"blocksize {blocksize} M={m}",
                               exact_w=m == 1)


@needs_interpreter
def test_input_layouts_and_params4bit():
    """A Params4bit (its quant_state is used), x with leading dimensions, x that is a strided or
    misaligned view, and a bias of another dtype."""
    p = bnb.nn.Params4bit((torch.randn(48, 128) * 0.1).half(), requires_grad=False, quant_type="nf4")._quantize("cpu")
    x3 = torch.randn(2, 1, 128).half()
    with use_triton(True):
        y = nf4_matvec(x3, p)
    assert y.shape == (2, 1, 48)
    assert_within_rounding(y, x3, p.data, p.quant_state, None, "Params4bit, [2, 1, K]")
    big = torch.randn(3, 130).half()
    bias = torch.randn(48, dtype=torch.float32)  # another dtype than x: read as fp32
    for view in (big[:, 1:129], big[:, :128], torch.randn(128, 3).half().t()):  # misaligned, strided, transposed
        with use_triton(True):
            y = nf4_matvec(view, p, bias=bias)
        assert_within_rounding(y, view, p.data, p.quant_state, bias, f"x of strides {view.stride()}")
    with use_triton(True):  # one row: the row kernel, x a misaligned view
        y = nf4_matvec(big[:1, 1:129], p, bias=bias)
    assert_within_rounding(y, big[:1, 1:129], p.data, p.quant_state, bias, "one misaligned row", exact_w=True)


@needs_interpreter
def test_nan_in_x_reaches_the_output():
    packed, qs = _nf4_weight(40, 128, torch.float16, nested=True)
    for m in (1, 4):
        x, _ = _inputs(m, 40, 128, torch.float16, False)
        x[0, 77] = float("nan")
        y = _kernel(x, packed, qs)
        assert torch.isnan(y[0]).all(), "a NaN in x must make its whole row NaN"
        if m > 1:
            assert torch.isfinite(y[1:]).all()


# --------------------------------------------------------------------------------------------------
# Fallbacks and support
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(24, 80), (19, 77), (33, 96)], ids=["80-straddling", "77-odd", "96-straddling"])
def test_rows_that_are_not_whole_blocks_are_decoded_then_multiplied(shape):
    """bitsandbytes quantises the flat weight, so with K % 64 != 0 blocks straddle rows: the kernel
    declines (supported() is False) and nf4_matvec decodes the weight and multiplies, same numbers."""
    n, k = shape
    packed, qs = _nf4_weight(n, k, torch.float16, nested=True)
    x, bias = _inputs(2, n, k, torch.float16, True)
    with use_triton(interpreter_on()):
        assert not nf4_matvec_supported(x, (packed, qs))
        y = nf4_matvec(x, (packed, qs), bias=bias)
    assert_within_rounding(y, x, packed, qs, bias, f"fallback {shape}")


def test_more_rows_than_the_kernel_takes_fall_back():
    packed, qs = _nf4_weight(24, 128, torch.float32, nested=False)
    x, bias = _inputs(MAX_ROWS + 1, 24, 128, torch.float32, True)
    with use_triton(interpreter_on()):
        assert not nf4_matvec_supported(x, (packed, qs))
        assert nf4_matvec_supported(x[:MAX_ROWS], (packed, qs)) == interpreter_on()
        y = nf4_matvec(x, (packed, qs), bias=bias)
    assert_within_rounding(y, x, packed, qs, bias, "17 rows")


def test_the_bound_catches_one_wrong_code():
    """Negative control: one code moved to the neighbouring level in one row breaks the bound there."""
    packed, qs = _nf4_weight(24, 128, torch.float16, nested=False)
    x, _ = _inputs(2, 24, 128, torch.float16, False)
    bad = packed.clone()
    bad[64 * 5 + 3, 0] ^= 0x10  # row 5: the high nibble of its 4th byte
    y_bad = nf4_matvec_reference(x, (bad, qs))
    with pytest.raises(AssertionError, match="beyond the rounding bound"):
        assert_within_rounding(y_bad, x, packed, qs, None, "one wrong code")
    y_bad = nf4_matvec_reference(x.float(), (bad, qs)).to(x.dtype)  # w not rounded: the row kernel's bound
    with pytest.raises(AssertionError, match="beyond the rounding bound"):
        assert_within_rounding(y_bad, x, packed, qs, None, "one wrong code", exact_w=True)


def test_cpu_path_is_the_reference():
    packed, qs = _nf4_weight(24, 128, torch.bfloat16, nested=True)
    x, bias = _inputs(3, 24, 128, torch.bfloat16, True)
    with use_triton(False):
        y = nf4_matvec(x, (packed, qs), bias=bias)
    assert torch.equal(y, nf4_matvec_reference(x, (packed, qs), bias))
    assert_within_rounding(y, x, packed, qs, bias, "reference")


def test_ways_to_pass_the_weight():
    """A pair (bytes, quant_state), the bytes with quant_state=..., and bias as the third positional
    argument (the shared generation interface: nf4_matvec(x, weight, bias=None)) agree."""
    packed, qs = _nf4_weight(24, 128, torch.float32, nested=True)
    x, bias = _inputs(2, 24, 128, torch.float32, True)
    with use_triton(interpreter_on()):
        a = nf4_matvec(x, (packed, qs), bias)
        b = nf4_matvec(x, packed, bias=bias, quant_state=qs)
        assert nf4_matvec_supported(x, packed, quant_state=qs) == interpreter_on()
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="pair"):
        nf4_matvec(x, (packed, qs, None))


def test_supported_never_raises():
    packed, qs = _nf4_weight(24, 128, torch.float16, nested=False)
    x = torch.randn(1, 128).half()
    with use_triton(interpreter_on()):
        assert not nf4_matvec_supported(x.int(), (packed, qs))  # dtype
        assert not nf4_matvec_supported(torch.randn(1, 64).half(), (packed, qs))  # features
        assert not nf4_matvec_supported(x, (packed, None))  # no quant state
        assert not nf4_matvec_supported(x, (torch.zeros(5, dtype=torch.uint8), qs))  # bytes of another weight


# --------------------------------------------------------------------------------------------------
# The launcher's choices and errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (37, 320)])
def test_matvec_config_choices(n, k, monkeypatch):
    one = matvec_config(1, n, k, 64, sm_count=132)
    monkeypatch.setenv("NOTEBOOKKIT_NF4_ROWS_IN_THREAD", "1")  # the A/B switch: where a program gets 4 rows
    switched = matvec_config(1, n, k, 64, sm_count=132)
    assert switched.rows_in_thread == (one.block_n == 4) and switched.step_blocks * 64 <= triton_next_pow2(k)
    monkeypatch.delenv("NOTEBOOKKIT_NF4_ROWS_IN_THREAD")
    assert not one.use_dot
    assert one.step_blocks * 64 <= triton_next_pow2(k)
    if n >= 2 * 132:
        assert -(-n // one.block_n) >= 132, "M=1 must leave at least one program per SM"
    assert one.block_n * one.step_blocks * 32 <= 4096
    for m in (2, 8, 16):
        many = matvec_config(m, n, k, 64, sm_count=132)
        assert many.use_dot and many.block_n >= 16 and many.step_blocks * 32 >= 16
        programs = -(-n // many.block_n) * many.split_k
        assert many.split_k == 8 or (programs >= 3 * 132 and k <= 2048 * many.split_k), "the card left short"
        # the fewest such splits: half as many would leave the card short or a loop too long
        assert many.split_k == 1 or -(-n // many.block_n) * many.split_k // 2 < 3 * 132 or k > 1024 * many.split_k


@pytest.mark.parametrize("n,k,split", [(4096, 4096, 4), (1024, 4096, 8), (14336, 4096, 2), (4096, 14336, 8)])
def test_batch_8_takes_the_sweeps_split_along_k(n, k, split):
    """Session 50's sweep on an H100 (M = 8, bf16): the fastest or within 3% of it at each 8B decode shape."""
    config = matvec_config(8, n, k, 64, sm_count=132)
    assert (config.block_n, config.num_warps, config.split_k) == (32, 2, split)


def triton_next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def test_errors_speak_to_the_user():
    packed, qs = _nf4_weight(24, 128, torch.float16, nested=False)
    with pytest.raises(ValueError, match="last dimension of x must be 128"):
        nf4_matvec(torch.randn(2, 64).half(), (packed, qs))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        nf4_matvec(torch.randint(0, 3, (2, 128)), (packed, qs))
    with pytest.raises(ValueError, match="bias must have 24 elements"):
        nf4_matvec(torch.randn(2, 128).half(), (packed, qs), torch.zeros(23).half())
    with pytest.raises(ValueError, match="QuantState"):
        nf4_matvec(torch.randn(2, 128).half(), packed)
    with pytest.raises(ValueError, match="power of two"):
        MatvecConfig(block_n=12, step_blocks=1, use_dot=False)
    with pytest.raises(ValueError, match="block_n >= 16"):
        MatvecConfig(block_n=8, step_blocks=1, use_dot=True)
    with pytest.raises(ValueError, match="row kernel"):
        MatvecConfig(block_n=16, step_blocks=1, use_dot=True, prefetch=True)
    with pytest.raises(ValueError, match="rows_in_thread is the row kernel's with block_n=4"):
        MatvecConfig(block_n=2, step_blocks=1, use_dot=False, rows_in_thread=True)
    with pytest.raises(ValueError, match="split_k is the tl.dot kernel's"):
        MatvecConfig(block_n=4, step_blocks=1, use_dot=False, split_k=2)
    with pytest.raises(ValueError, match="split_k must be a power of two"):
        MatvecConfig(block_n=16, step_blocks=1, use_dot=True, split_k=3)
    if interpreter_on():
        with use_triton(True), pytest.raises(ValueError, match="one row of x"):
            nf4_matvec(torch.randn(2, 128).half(), (packed, qs), config=MatvecConfig(4, 1, use_dot=False))


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

GPU_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (1024, 4096)]


def _assert_within_rounding_chunked(y, x, packed, qs, bias, what, exact_w=False):
    """The bound of ``assert_within_rounding`` for a large weight, decoded by notebookkit's reference
    (bit-exact with the definition, ``test_nf4.py``) 8192 rows at a time in float64."""
    from notebookkit.kernels.nf4 import dequantize_nf4_reference

    w = dequantize_nf4_reference(packed, qs, out_dtype=torch.float32 if exact_w else x.dtype)
    k = x.shape[-1]
    terms = 3 * k + 1 if exact_w else k + 1
    g = terms * 2.0**-24 / (1 - terms * 2.0**-24)
    u = UNIT_ROUNDOFF[x.dtype]
    x64 = x.double().reshape(-1, k)
    assert torch.isfinite(y).all(), f"{what}: NaN/Inf in the output"
    for r0 in range(0, w.shape[0], 8192):
        w64 = w[r0:r0 + 8192].double()
        ref, size = x64 @ w64.t(), x64.abs() @ w64.abs().t()
        if bias is not None:
            b = bias[r0:r0 + 8192].double()
            ref, size = ref + b, size + b.abs()
        bound = u * (ref.abs() + g * size) + g * size + torch.finfo(x.dtype).tiny
        excess = (y.reshape(-1, w.shape[0])[:, r0:r0 + 8192].double() - ref).abs() - bound
        assert (excess <= 0).all(), f"{what}: {int((excess > 0).sum())} elements beyond the rounding bound (rows {r0}+)"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"{n}x{k}" for n, k in GPU_SHAPES])
def test_gpu_large_shapes(shape, dtype):
    n, k = shape
    packed, qs = _nf4_weight(n, k, dtype, nested=True, device="cuda")
    for m, with_bias in ((1, False), (8, True), (16, False)):
        x, bias = _inputs(m, n, k, dtype, with_bias, device="cuda")
        assert nf4_matvec_supported(x, (packed, qs))
        y = nf4_matvec(x, (packed, qs), bias=bias)
        _assert_within_rounding_chunked(y, x, packed, qs, bias, f"{shape} M={m} {dtype}", exact_w=m == 1)
        if m > 1:
            ref = nf4_matvec_reference(x, (packed, qs), bias)
            assert rel_err(y, ref) <= 2 * UNIT_ROUNDOFF[dtype] + TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_lora_term(m, dtype):
    """The LoRA term on the GPU (bf16 through tl.dot is GPU-only): the bound, and the kernel's one rounding
    against the reference's."""
    packed, qs = _nf4_weight(1024, 4096, dtype, nested=True, device="cuda")
    x, _ = _inputs(m, 1024, 4096, dtype, False, device="cuda")
    lora = _lora_term(m, 1024, 16, dtype, device="cuda")
    y = nf4_matvec(x, (packed, qs), lora=lora)
    assert_within_rounding(y, x, packed, qs, None, f"M={m} {dtype}", lora=lora, exact_w=m == 1)
    if m > 1:
        ref = nf4_matvec_reference(x, (packed, qs), lora=lora)
        assert rel_err(y, ref) <= 2 * UNIT_ROUNDOFF[dtype] + TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [MatvecConfig(8, 8, False), MatvecConfig(4, 16, False, prefetch=True),
                                    MatvecConfig(32, 2, True, 2), MatvecConfig(64, 2, True),
                                    MatvecConfig(32, 2, True, 2, split_k=8),
                                    MatvecConfig(16, 4, True, 1), ROWS_IN_THREAD_CONFIG], ids=_config_id)
def test_gpu_configs_plain_absmax(config):
    packed, qs = _nf4_weight(4096, 4096, torch.bfloat16, nested=False, device="cuda")
    x, bias = _inputs(1, 4096, 4096, torch.bfloat16, True, device="cuda")
    y = nf4_matvec(x, (packed, qs), bias=bias, config=config)
    _assert_within_rounding_chunked(y, x, packed, qs, bias, str(config), exact_w=not config.use_dot)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", [None, ROWS_IN_THREAD_CONFIG], ids=["auto", "rows-in-thread"])
def test_gpu_group_of_the_8b_attention_and_mlp(dtype, config):
    """Llama-3.1-8B's q/k/v (4096, 1024, 1024 rows) with LoRA and its gate/up (14336 x 2) in one launch each:
    every output the one-weight kernel's bits at the same tiling, also when replayed from a CUDA graph, and
    within the rounding bound of the definition."""
    for ns, k, with_lora in (((4096, 1024, 1024), 4096, True), ((14336, 14336), 4096, False)):
        x, weights, biases, loras = _group(ns, k, dtype, True, False, with_lora, device="cuda", rank=16)
        tiling = config or matvec_config(1, sum(ns), k,
                                         sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
        alone = [nf4_matvec(x, w, lora=lo, config=tiling) for w, lo in zip(weights, loras)]
        eager = nf4_matvec_group(x, weights, biases, loras=loras, config=config)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = nf4_matvec_group(x, weights, biases, loras=loras, config=config)
        graph.replay()
        torch.cuda.synchronize()
        for y, y_graph, y_alone in zip(eager, captured, alone):
            assert torch.equal(y, y_alone) and torch.equal(y_graph, y_alone), f"{ns} {dtype}"
        if with_lora:  # k_proj's 1024 rows (nested absmax, LoRA): the definition's rounding bound
            assert_within_rounding(eager[1], x, *weights[1], None, f"k_proj {dtype} {config}", lora=loras[1],
                                   exact_w=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_cuda_graph_capture_and_replay(m):
    """Captured once, replayed on new inputs written into the static buffer: the same bits as an
    eager call (the kernel is deterministic: no split over K, no atomics)."""
    packed, qs = _nf4_weight(4096, 4096, torch.bfloat16, nested=True, device="cuda")
    x, bias = _inputs(m, 4096, 4096, torch.bfloat16, True, device="cuda")
    static_x = x.clone()
    nf4_matvec(static_x, (packed, qs), bias=bias)  # warm-up: compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = nf4_matvec(static_x, (packed, qs), bias=bias)
    for seed in (7, 8):
        fresh, _ = _inputs(m, 4096, 4096, torch.bfloat16, False, seed=seed, device="cuda")
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, nf4_matvec(fresh, (packed, qs), bias=bias))
        _assert_within_rounding_chunked(static_y, fresh, packed, qs, bias, f"replay M={m}", exact_w=m == 1)
