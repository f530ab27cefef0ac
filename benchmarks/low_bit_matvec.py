"""The decode matvec of 2-bit and ternary bases (``kernels/low_bit_matvec.py``): a launch-configuration sweep.

For each projection shape of an 8B (or 70B) Llama at one decode row (``M = 1``, bf16), times each candidate
``BLOCK_N,blocks a step,warps`` (a block is up to 64 weights of a row sharing a scale) (median µs of ``triton.testing.do_bench_cudagraph``: replayed from a CUDA graph as
the decode step is, so the host's launch cost is not timed) and reports the bytes a call
reads (codes, scales, zeros and ``x``) per second, and that rate as a share of the card's copy bandwidth
(a 1 GiB device-to-device copy: read + write bytes / time). One configuration serves every shape, so the pick
is the one with the least time over a layer's seven projections (q, k, v, o, gate, up, down). Also timed:
the dense bf16 GEMV on cuBLAS (``x @ W^T``, 16 bits a weight: the bound's reference) and the library's
``CONFIG``. A candidate must match the dense product of the dequantised weight first.

It prints one ``ROW {json}`` per (format, config, shape) and a ``BEST`` line per format.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

SHAPES = {
    "llama-3.1-8b": {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
                     "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)},
    "llama-3.1-70b": {"q": (8192, 8192), "k": (1024, 8192), "v": (1024, 8192), "o": (8192, 8192),
                      "gate": (28672, 8192), "up": (28672, 8192), "down": (8192, 28672)},
}


def bench_us(fn) -> float:
    import triton

    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def copy_gb_s() -> float:
    import triton

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (1000 * triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50)) / 1e3


def packed(fmt: str, n: int, k: int):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if fmt == "2bit":
        from notebookkit.kernels.q2 import dequantize_q2, quantize_q2

        q = quantize_q2(w, method="minmax")
        return q, dequantize_q2(q, torch.bfloat16), q.nbytes()
    from notebookkit.kernels.ternary import dequantize_ternary, quantize_ternary

    q = quantize_ternary(w)
    return q, dequantize_ternary(q, torch.bfloat16), q.nbytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="2bit,ternary")
    ap.add_argument("--block-n", default="1,2,4,8,16")
    ap.add_argument("--step", default="8,16,32,64", help="blocks of a row a loop step")
    ap.add_argument("--warps", default="1,2,4,8")
    args = ap.parse_args()
    from notebookkit.kernels import low_bit_matvec as mod

    torch.manual_seed(0)
    bandwidth = copy_gb_s()
    print(f"COPY {bandwidth:.0f} GB/s (1 GiB device-to-device, read + write)", flush=True)
    grid = itertools.product(*(tuple(int(v) for v in getattr(args, a).split(",")) for a in ("block_n", "step", "warps")))
    # tiles of 8 to 64 code bytes a thread (fewer starve the loads, more spill)
    candidates = [mod.CONFIG] + [c for c in grid if c != mod.CONFIG and 8 <= c[0] * c[1] * 16 / (32 * c[2]) <= 64]
    for fmt in args.formats.split(","):
        layer = {name: packed(fmt, n, k) for name, (n, k) in SHAPES[args.shape].items()}
        xs = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in SHAPES[args.shape].items()}
        dense_us = {name: bench_us(lambda: xs[name] @ layer[name][1].t()) for name in layer}
        totals = {}
        for cfg in candidates:
            try:
                times = {}
                for name, (q, dense, nbytes) in layer.items():
                    y = mod.low_bit_matvec(xs[name], q, cfg)
                    want = (xs[name].float() @ dense.float().t())
                    err = float((y.float() - want).abs().max() / want.abs().max())
                    if err > 2e-2:
                        raise RuntimeError(f"{name}: wrong result (relative error {err:.3g})")
                    times[name] = bench_us(lambda: mod.low_bit_matvec(xs[name], q, cfg))
            except Exception as e:  # a configuration that does not compile
                print(f"SKIP {fmt} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            totals[cfg] = sum(times.values())
            for name, us in times.items():
                nbytes = layer[name][2] + 2 * xs[name].numel()
                print("ROW " + json.dumps(dict(format=fmt, shape=args.shape, proj=name, config=list(cfg),
                                               library=cfg == mod.CONFIG, us=round(us, 2), dense_us=round(dense_us[name], 2),
                                               gb_s=round(nbytes / us / 1e3), of_copy=round(nbytes / us / 1e3 / bandwidth, 3))),
                      flush=True)
        layer_bytes = sum(v[2] for v in layer.values())
        best = min(totals, key=totals.get)
        print(f"BEST {fmt} {args.shape}: config {list(best)} {totals[best]:.1f} us a layer "
              f"({layer_bytes / totals[best] / 1e3:.0f} GB/s, {layer_bytes / totals[best] / 1e3 / bandwidth:.0%} of copy); "
              f"library {list(mod.CONFIG)} {totals.get(mod.CONFIG, float('nan')):.1f} us; "
              f"dense bf16 GEMV {sum(dense_us.values()):.1f} us", flush=True)


if __name__ == "__main__":
    main()
