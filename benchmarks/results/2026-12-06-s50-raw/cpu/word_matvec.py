"""Prototype (scratch, not the library): the batch-1 NF4 matvec reading codes as 32-bit words, each nibble's level by
one warp shuffle of the word shifted into place (the duplicated lane table ignores bit 4), x as fp32 or 16-bit,
a word's 8 products summed in fp32, then times the block scale once. Census of its SASS per weight byte on sm_90, and
its result against nf4_matvec_reference under the interpreter."""
import os, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch, triton, triton.language as tl
import notebookkit.kernels.nf4_matvec as m


@triton.jit
def _split8(t):
    """The 8 tensors t[..., j] of a [..., 8] tensor, j = 0..7 (splits keep the last dimension in one thread)."""
    shape: tl.constexpr = t.shape
    t = tl.reshape(t, (shape[0], shape[1], 2, 2, 2))
    e0, e1 = tl.split(t)  # j = 4a + 2b + c: c split first
    e00, e01 = tl.split(e0)
    e10, e11 = tl.split(e1)
    x0, x4 = tl.split(e00)
    x2, x6 = tl.split(e01)
    x1, x5 = tl.split(e10)
    x3, x7 = tl.split(e11)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_kernel(x_ptr, words_ptr, absmax_ptr, table_ptr, y_ptr, N, words_per_row,
                 BLOCK_N: tl.constexpr, STEP_WORDS: tl.constexpr, BLOCKSIZE: tl.constexpr, LANE_TABLE: tl.constexpr,
                 FUSE: tl.constexpr):
    WPB: tl.constexpr = BLOCKSIZE // 8  # words of a block
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    lane_level = m._lane_level(table_ptr, LANE_TABLE)
    j = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_N, STEP_WORDS), dtype=tl.float32)
    blocks_per_row = words_per_row // WPB
    for s in range(0, words_per_row // STEP_WORDS):
        w = s * STEP_WORDS + tl.arange(0, STEP_WORDS)
        code = tl.load(words_ptr + rows[:, None] * words_per_row + w[None, :])  # [N, W] int32
        a = tl.load(absmax_ptr + rows[:, None] * blocks_per_row + (w // WPB)[None, :])  # [N, W] (L1)
        xv = tl.load(x_ptr + (w[None, :, None] * 8 + j[None, None, :] + 0 * rows[:, None, None])).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xv)
        # element 2i is the high nibble of byte i; the shuffle reads the low 5 bits (the lane table is doubled)
        part = m._nf4_level(lane_level, table_ptr, code >> 4, LANE_TABLE) * x0
        part = tl.fma(m._nf4_level(lane_level, table_ptr, code, LANE_TABLE), x1, part)
        part = tl.fma(m._nf4_level(lane_level, table_ptr, code >> 12, LANE_TABLE), x2, part)
        part = tl.fma(m._nf4_level(lane_level, table_ptr, code >> 8, LANE_TABLE), x3, part)
        part = tl.fma(m._nf4_level(lane_level, table_ptr, code >> 20, LANE_TABLE), x4, part)
        part = tl.fma(m._nf4_level(lane_level, table_ptr, code >> 16, LANE_TABLE), x5, part)
        part = tl.fma(m._nf4_level(lane_level, table_ptr, code >> 28, LANE_TABLE), x6, part)
        part = tl.fma(m._nf4_level(lane_level, table_ptr, code >> 24, LANE_TABLE), x7, part)
        acc = tl.fma(part, a, acc)
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def census(x_ty: str, block_n: int, step_words: int, warps: int, fuse: bool) -> None:
    import ptx_census as pc
    sig = {"x_ptr": f"*{x_ty}", "words_ptr": "*i32", "absmax_ptr": "*fp32", "table_ptr": "*fp32", "y_ptr": f"*{x_ty}",
           "N": "i32", "words_per_row": "i32"}
    cx = {"BLOCK_N": block_n, "STEP_WORDS": step_words, "BLOCKSIZE": 64, "LANE_TABLE": True, "FUSE": fuse}
    m.AOT_SPECS.append((_word_kernel, sig, cx, {"num_warps": warps, "enable_fp_fusion": fuse}))
    asm, c, o = pc.compile_spec("nf4_matvec", len(m.AOT_SPECS) - 1, 90, {})
    counts = pc.sass_opcodes(pc.sass_hot_loop(pc.disassemble(asm["cubin"])))
    per = block_n * step_words * 4 / (32 * warps)
    print(f"x {x_ty} rows {block_n} words {step_words} warps {warps} fusion {fuse}: {sum(counts.values())} SASS, "
          f"{per:g} B/thread, {sum(counts.values()) / per:.2f} a byte; {counts.most_common(14)}")


def check() -> None:
    from notebookkit.kernels.nf4 import quantize_nf4_reference  # noqa: F401 - if present


def check(n=48, k=512, dtype=torch.float16) -> None:
    """Under the interpreter: the word kernel against a float64 product of the NF4-decoded weight."""
    import bitsandbytes.functional as bnbF
    from notebookkit.kernels.nf4 import dequantize_nf4_reference
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    x = torch.randn(1, k, generator=g).to(dtype)
    wd = dequantize_nf4_reference(packed, qs, out_dtype=torch.float32).double()
    ref = x.double() @ wd.t()
    words = packed.reshape(-1).view(torch.int32)
    y = torch.empty(n, dtype=dtype)
    table = torch.tensor(__import__("notebookkit.kernels.nf4", fromlist=["NF4_LEVELS"]).NF4_LEVELS, dtype=torch.float32)
    _word_kernel[(n // 16,)](x.reshape(-1), words, qs.absmax.float(), table, y, n, k // 8,
                             BLOCK_N=16, STEP_WORDS=16, BLOCKSIZE=64, LANE_TABLE=False, FUSE=False)
    err = (y.double() - ref.reshape(-1)).abs().max().item()
    print(f"interpreter check n={n} k={k} {dtype}: max |y - ref| {err:.3g} (ref max {ref.abs().max().item():.3g})")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        check()
    else:
        for x_ty in ("fp32", "bf16"):
            for bn, sw, wp in ((4, 256, 4), (8, 128, 4), (4, 128, 2), (2, 256, 2), (1, 512, 4)):
                for fuse in (False,):
                    census(x_ty, bn, sw, wp, fuse)
