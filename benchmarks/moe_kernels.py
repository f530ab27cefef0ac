"""The grouped expert MLP (``kernels/moe_experts.py``) alone on the GPU: forward and forward + backward of one
sparse block at the public MoE shapes, NF4 or 16-bit experts, over a grid of launch configurations, beside
``torch._grouped_mm`` on the same rows (the cuBLAS / CUTLASS grouped GEMM: what the GEMMs alone can cost).

    python benchmarks/moe_kernels.py [--shapes qwen3-30b-a3b,gpt-oss-20b] [--tokens 2048] [--out DIR]
    python benchmarks/moe_kernels.py --library      # the library's own configuration and NF4 rule

Each row: median of ``--iters`` timed calls (CUDA events) after warm-up, random routing (softmax top-k of
Gaussian logits), LoRA r=16 on both stacked weights. ``dense-after-dequant`` times the 16-bit kernel plus
``dequantize_nf4`` of both stacked weights per call (what a step pays when it decodes once per use).
The launch configuration is swapped by replacing ``moe_experts._config`` (a sweep, not library code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from notebookkit.export.nf4_quantize import quantize_nf4  # noqa: E402
from notebookkit.kernels import moe_experts  # noqa: E402
from notebookkit.kernels.moe_experts import expert_lora, moe_expert_mlp  # noqa: E402
from notebookkit.kernels.nf4 import dequantize_nf4  # noqa: E402
from notebookkit.kernels.nf4_stacked import nf4_stacked  # noqa: E402

SHAPES = {  # tokens' hidden H, expert width I, experts E, top-k, activation, gpt-oss layout
    "qwen3-30b-a3b": dict(H=2048, I=768, E=128, k=8, activation="swiglu", gpt=False),
    "gpt-oss-20b": dict(H=2880, I=2880, E=32, k=4, activation="gpt_oss", gpt=True),
}
CONFIGS = [(64, 64, 32, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4),
           (128, 128, 32, 8, 4)]


def timed(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def case(shape: str, tokens: int, dtype=torch.bfloat16, r: int = 16):
    s = SHAPES[shape]
    H, I, E, k = s["H"], s["I"], s["E"], s["k"]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(tokens, H, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_()
    logits = torch.randn(tokens, E, device="cuda", generator=g)
    topk_w, topk_idx = torch.softmax(logits, -1).topk(k, dim=-1)
    topk_w = topk_w.to(dtype).requires_grad_()
    stored_gu = (torch.randn(E, H, 2 * I, device="cuda", generator=g) * 0.02).to(dtype) if s["gpt"] else \
        (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).to(dtype)
    stored_d = (torch.randn(E, I, H, device="cuda", generator=g) * 0.02).to(dtype) if s["gpt"] else \
        (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).to(dtype)
    weights = {}
    for name, stored in (("gu", stored_gu), ("d", stored_d)):
        q = quantize_nf4(stored)
        view = nf4_stacked(q.packed, q, transposed=s["gpt"])
        dense = dequantize_nf4(q.packed, q, out_dtype=dtype)
        weights[name] = (view, dense.transpose(1, 2) if s["gpt"] else dense, q)
    lora = []
    for fan_out, fan_in in ((2 * I, H), (H, I)):
        A = (torch.randn(r * E, fan_in, device="cuda", generator=g) * 0.02).to(dtype).requires_grad_()
        B = (torch.randn(fan_out, r * E, device="cuda", generator=g) * 0.02).to(dtype).requires_grad_()
        lora.append((A, B))
    bias = dict(gate_up_bias=torch.zeros(E, 2 * I, device="cuda", dtype=dtype),
                down_bias=torch.zeros(E, H, device="cuda", dtype=dtype)) if s["gpt"] else {}
    return s, x, topk_idx, topk_w, weights, lora, bias


def run_case(shape: str, tokens: int, iters: int, library: bool = False) -> list[dict]:
    s, x, topk_idx, topk_w, weights, lora, bias = case(shape, tokens)
    E = s["E"]
    dy = torch.randn_like(x)

    def call(kind: str, backward: bool):
        gu = weights["gu"][0] if kind == "nf4" else weights["gu"][1]
        d = weights["d"][0] if kind == "nf4" else weights["d"][1]
        if kind == "dense-after-dequant":
            for name in ("gu", "d"):
                _, _, q = weights[name]
                dequantize_nf4(q.packed, q, out_dtype=x.dtype)
        loras = [expert_lora(A, B, E, 1.0) for A, B in lora]
        y = moe_expert_mlp(x, topk_idx, topk_w, gu, d, gate_up_lora=loras[0], down_lora=loras[1],
                           activation=s["activation"], **bias)
        if backward:
            y.backward(dy)

    rows = []
    flops = 2 * tokens * s["k"] * 3 * s["H"] * s["I"]  # forward: gate_up (2I x H) + down (H x I) per pair
    original = moe_experts._config
    try:
        for cfg in [None] if library else CONFIGS:
            if cfg is not None:
                moe_experts._config = lambda *_, cfg=cfg: moe_experts._Config(*cfg)
            for kind in ("nf4", "dense") if library else ("nf4", "dense", "dense-after-dequant"):
                row = dict(shape=shape, tokens=tokens, weights=kind, config=list(cfg) if cfg else "library")
                try:
                    row["fwd_ms"] = timed(lambda: call(kind, False), iters)
                    row["fwd_bwd_ms"] = timed(lambda: call(kind, True), iters)
                    row["fwd_tflops"] = round(flops / row["fwd_ms"] / 1e9, 1)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        moe_experts._config = original
    rows.append(grouped_mm_row(shape, tokens, s, x, topk_idx, weights, iters))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def grouped_mm_row(shape, tokens, s, x, topk_idx, weights, iters) -> dict:
    """``torch._grouped_mm`` forward of the two GEMMs on the expert-sorted rows (no activation, no LoRA)."""
    row = dict(shape=shape, tokens=tokens, weights="torch._grouped_mm (bf16 GEMMs only)")
    if not hasattr(torch, "_grouped_mm"):
        return row | dict(error="no torch._grouped_mm")
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=s["E"])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x.detach()[order // s["k"]].contiguous()
    wgu = weights["gu"][1].transpose(1, 2)  # [E, H, 2I]
    wd = weights["d"][1].transpose(1, 2)  # [E, I, H]

    def fwd():
        gu = torch._grouped_mm(xs, wgu, offs=offs)
        h = gu[:, : s["I"]].contiguous()
        return torch._grouped_mm(h, wd, offs=offs)

    try:
        row["fwd_ms"] = timed(fwd, iters)
        row["fwd_tflops"] = round(2 * tokens * s["k"] * 3 * s["H"] * s["I"] / row["fwd_ms"] / 1e9, 1)
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--library", action="store_true",
                    help="the library's own configuration and NF4 rule only (NF4 and 16-bit experts)")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        rows += run_case(shape, args.tokens, args.iters, args.library)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe-kernels.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
