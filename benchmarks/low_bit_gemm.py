"""The 2-bit and ternary base GEMMs against cuBLAS on the dense weight: a tile sweep on the GPU.

For each projection shape of an 8B (or 70B) Llama and a token count ``M``, times (``triton.testing.do_bench``,
median ms, and TFLOP/s as ``2 M N K / t``):

* ``dense``: ``x @ W^T`` in bf16 on cuBLAS: what NF4's path does after its dequantise (the bound);
* ``deq+dense``: dequantise the packed weight to bf16 (our Triton kernel), then cuBLAS: the "dense copy" way;
* ``chunks``: the library's many-rows path (``kernels/chunked_dequant_matmul.py``: the same, a 32 MiB chunk at
  a time);
* ``fwd`` / ``bwd``: the dequant-in-GEMM kernels (``q2_matmul`` / ``q2_matmul_backward_input``, or the ternary
  pair) under each candidate tile config (``--configs``, each ``BM,BN,BK,warps,stages``); the library's own
  ``_config`` first.

A candidate is tried by swapping the module's ``_config`` for the run; nothing is written back. It prints one
``ROW {json}`` per (format, shape, M, way) and a ``BEST`` line per (format, shape, M, direction).
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {
    "llama-3.1-8b": {"qo": (4096, 4096), "kv": (1024, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)},
    "llama-3.1-70b": {"qo": (8192, 8192), "kv": (1024, 8192), "gate_up": (28672, 8192), "down": (8192, 28672)},
}
DEFAULT_CONFIGS = ["64,64,64,4,3", "128,64,64,4,3", "128,128,64,8,3", "128,128,64,4,4", "128,256,64,8,3",
                   "256,128,64,8,3", "64,128,64,4,4"]


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50)


def weights(fmt: str, n: int, k: int):
    """A packed weight of ``[n, k]`` quantised from a random Gaussian, and its dequantise function."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if fmt == "2bit":
        from notebookkit.kernels.q2 import dequantize_q2, quantize_q2

        q = quantize_q2(w, method="minmax")
        return q, lambda: dequantize_q2(q, torch.bfloat16)
    from notebookkit.kernels.ternary import dequantize_ternary, quantize_ternary

    q = quantize_ternary(w)
    return q, lambda: dequantize_ternary(q, torch.bfloat16)


def kernels(fmt: str):
    """(module, forward, input gradient, config adapter) of a format's dequant-in-GEMM kernels."""
    if fmt == "2bit":
        from notebookkit.kernels import q2_matmul as mod

        return mod, mod.q2_matmul, mod.q2_matmul_backward_input, lambda c: (lambda *_: tuple(c))
    from notebookkit.kernels import ternary_matmul as mod

    # the ternary launcher takes (BM, BN, BK, warps): stages stay Triton's default
    return mod, mod.ternary_matmul, mod.ternary_input_grad, lambda c: (lambda *_: tuple(c[:4]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="2bit,ternary")
    ap.add_argument("--m", default="8192", help="token counts, comma separated")
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS, help="tile candidates; none: skip the sweep")
    args = ap.parse_args()
    from notebookkit.kernels.chunked_dequant_matmul import (chunked_dequant_matmul,
                                                            chunked_dequant_matmul_backward_input)

    torch.manual_seed(0)
    for fmt in args.formats.split(","):
        mod, fwd, bwd, adapt = kernels(fmt)
        library = mod._config
        for name, (n, k) in SHAPES[args.shape].items():
            q, deq = weights(fmt, n, k)
            dense = deq()
            for m in (int(v) for v in args.m.split(",")):
                flop = 2 * m * n * k
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                rows = {"dense fwd": bench(lambda: x @ dense.t()), "dense bwd": bench(lambda: dy @ dense),
                        "deq+dense fwd": bench(lambda: x @ deq().t()), "deq+dense bwd": bench(lambda: dy @ deq()),
                        "chunks fwd": bench(lambda: chunked_dequant_matmul(x, q)),
                        "chunks bwd": bench(lambda: chunked_dequant_matmul_backward_input(dy, q))}
                ref_y, ref_dx = x @ dense.t(), dy @ dense
                for cfg in ["library"] + list(args.configs):
                    try:
                        mod._config = library if cfg == "library" else adapt([int(v) for v in cfg.split(",")])
                        y, dx = fwd(x, q), bwd(dy, q)
                        err = max(float((y.float() - ref_y.float()).abs().max() / ref_y.float().abs().max()),
                                  float((dx.float() - ref_dx.float()).abs().max() / ref_dx.float().abs().max()))
                        if err > 2e-2:
                            raise RuntimeError(f"wrong result (relative error {err:.3g})")
                        rows[f"fwd {cfg}"] = bench(lambda: fwd(x, q))
                        rows[f"bwd {cfg}"] = bench(lambda: bwd(dy, q))
                    except Exception as e:  # a config that does not compile or fit shared memory
                        print(f"SKIP {fmt} {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    finally:
                        mod._config = library
                for way, ms in rows.items():
                    print("ROW " + json.dumps(dict(format=fmt, shape=args.shape, proj=name, m=m, n=n, k=k, way=way,
                                                   ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1))), flush=True)
                for direction in ("fwd", "bwd"):
                    mine = {w: t for w, t in rows.items() if w.startswith(direction + " ")}
                    best = min(mine, key=mine.get)
                    print(f"BEST {fmt} {name} m={m} {direction}: {best} {mine[best]:.3f} ms "
                          f"({flop / mine[best] / 1e9:.0f} TFLOP/s) vs dense {rows['dense ' + direction]:.3f} ms, "
                          f"deq+dense {rows['deq+dense ' + direction]:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
