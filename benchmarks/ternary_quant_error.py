"""Reconstruction and output error of the ternary quantiser (notebookkit.kernels.ternary) on random
weights, by scale granularity and scale fit. Not timed; CPU; prints a markdown table.

Weights ``[1024, 1024]``: iid N(0, 1) ("gaussian"), and the same with a log-normal std per row
(sigma 0.5, "rows"), as trained layers' rows differ in scale. Inputs ``x [256, 1024]`` N(0, 1).

    weight error = ||W_q - W|| / ||W||        output error = ||x W_q^T - x W^T|| / ||x W^T||

Bits a weight: 2 (codes) + 16 / G (fp16 scales).

Run: PYTHONPATH=. python benchmarks/ternary_quant_error.py
"""

from __future__ import annotations

import torch

from notebookkit.kernels.ternary import dequantize_ternary_reference, quantize_ternary


def main() -> None:
    g = torch.Generator().manual_seed(0)
    o = k = 1024
    base = torch.randn(o, k, generator=g)
    weights = {
        "gaussian": base,
        "rows": base * torch.exp(0.5 * torch.randn(o, 1, generator=g)),
    }
    x = torch.randn(256, k, generator=g)
    fits = (("absmean", 0), ("refit", 1), ("alternate x4", 4))
    print("| weights | scales | bits/weight | fit | weight rel. err | output rel. err |")
    print("|---|---|---|---|---|---|")
    for wname, w in weights.items():
        ref = x @ w.t()
        for group in ("tensor", "row", 128, 64):
            bits = 2 + 16 / (k if group in ("row",) else (o * k if group == "tensor" else group))
            for fname, steps in fits:
                q = quantize_ternary(w, group, steps)
                wq = dequantize_ternary_reference(q, torch.float32)
                werr = ((wq - w).norm() / w.norm()).item()
                oerr = ((x @ wq.t() - ref).norm() / ref.norm()).item()
                print(f"| {wname} | {group} | {bits:.4f} | {fname} | {werr:.4f} | {oerr:.4f} |")


if __name__ == "__main__":
    main()
