"""Sweep the RMSNorm backward launch shape on the GPU and print GB/s per configuration.

    python benchmarks/tune_rms_norm.py [--out DIR]

The backward reads dy, x (and rstd) and writes dx, plus an fp32 partial row of dw per program that a
``sum(0)`` folds at the end. It is memory-bound; what matters is how many rows are in flight per SM.
Knobs (``notebookkit.kernels.rms_norm._bwd_launch``): rows per tile (``block_m``), warps, programs
per SM when dw is reduced, and software-pipelining stages of the row loop. Each configuration is
checked against the default one (identical dx, dw within fp32 summation-order noise) and timed from
CUDA-graph replays; the best per shape is printed last. The winners become the defaults in
``rms_norm.py``; ``benchmarks/kernels.py`` then measures the op as users call it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

SHAPES = {"llama [8192, 4096]": (8192, 4096), "qk_norm [262144, 128]": (262144, 128)}


def bench_ms(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def copy_gbps() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = float(do_bench(lambda: dst.copy_(src), warmup=25, rep=50, return_mode="median"))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def configs(n_cols: int):
    rows_per_tile, warps_options = ([1, 2, 4], [8, 16]) if n_cols >= 1024 else ([16, 32, 64], [4, 8])
    for block_m, warps, per_sm, stages in itertools.product(rows_per_tile, warps_options, [4, 8, 16], [1, 2, 3]):
        yield dict(block_m=block_m, num_warps=warps, programs_per_sm=per_sm, num_stages=stages)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--with-dw", default="1,0", help="1: weight trainable (dw reduced), 0: frozen weight")
    args = ap.parse_args()
    from notebookkit.kernels.rms_norm import rms_norm_backward, rms_norm_forward

    ceiling = copy_gbps()
    print(f"copy {ceiling:.0f} GB/s", flush=True)
    results = []
    for label, (rows, cols) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        w = (torch.rand(cols, device="cuda") + 0.5).to(torch.bfloat16)
        dy = torch.randn_like(x)
        dx = torch.empty_like(x)
        _, rstd = rms_norm_forward(x, w, 1e-6)
        for with_dw in [bool(int(v)) for v in args.with_dw.split(",")]:
            ref_dx, ref_dw = rms_norm_backward(dy, x, w, rstd, compute_dw=with_dw, dx_out=dx.clone())
            n_bytes = 3 * x.numel() * x.element_size()
            best = None
            seen_frozen = set()
            for cfg in configs(cols):
                if not with_dw:  # programs per SM does not apply: one program per tile
                    key = (cfg["block_m"], cfg["num_warps"], cfg["num_stages"])
                    if key in seen_frozen:
                        continue
                    seen_frozen.add(key)
                try:
                    got_dx, got_dw = rms_norm_backward(dy, x, w, rstd, compute_dw=with_dw, dx_out=dx, _config=cfg)
                    ok = torch.equal(got_dx, ref_dx) and (
                        not with_dw or torch.allclose(got_dw.float(), ref_dw.float(), rtol=1e-2, atol=1e-2)
                    )
                    ms = bench_ms(lambda: rms_norm_backward(dy, x, w, rstd, compute_dw=with_dw, dx_out=dx, _config=cfg))
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is just skipped
                    print(f"{label} dw={with_dw} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                row = dict(shape=label, with_dw=with_dw, **cfg, ms=round(ms, 4),
                           gbps=round(n_bytes / (ms * 1e-3) / 1e9), pct=round(100 * n_bytes / (ms * 1e-3) / 1e9 / ceiling, 1),
                           correct=ok)
                results.append(row)
                print(json.dumps(row), flush=True)
                if ok and (best is None or ms < best["ms"]):
                    best = row
            print(f"BEST {label} dw={with_dw}: {json.dumps(best)}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_rms_norm.json"), "w") as fh:
        json.dump(dict(copy_gbps=ceiling, rows=results), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
