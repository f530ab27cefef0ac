"""Kernel benchmark: every notebookkit op next to its PyTorch eager composition, torch.compile and
(when installed) Liger, at Llama-3.1-8B layer shapes, in one run on one GPU.

    python benchmarks/kernels.py --out benchmarks/results              # all ops, bf16, 8192 tokens
    python benchmarks/kernels.py --ops rms_norm,swiglu --dtype fp16 --tokens 4096

For each (op, implementation): median time of the forward and of forward + backward
(replayed from a CUDA graph with ``triton.testing.do_bench_cudagraph``, so host launch overhead,
which overlaps the GEMMs in a real step, is not counted; plain ``do_bench`` where capture fails), the bandwidth achieved on the ideal byte
count of the op (every input read once, every output written once), that bandwidth as a percentage
of a device-to-device copy measured in the same run, the peak memory allocated on top of the inputs,
and the relative error of the forward output against eager. A row is "ok" only when that error is
finite and within the dtype's kernel tolerance (``notebookkit.kernels.testing.TOLERANCE``); NaN or
a larger error marks it "wrong" (its times are still shown). Each row records how each time was
taken (``fwd_timing`` / ``fwdbwd_timing``: "cuda graph" replay, or "do_bench" with the reason capture
failed, where launch overhead is included). Results go to ``<out>/<date>-<gpu>-kernels.json`` and
``.md``; the markdown table is printed last.

Adding an op: append a ``BenchOp`` to ``OPS``. ``build(tokens, dtype, device)`` returns a ``Case``
(leaf inputs, upstream gradients, ideal byte counts and implementations). An op whose notebookkit
module is missing (another helper's op not merged yet) is reported as "missing", never a crash.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import math
import os
import platform
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

# Llama-3.1-8B layer
HIDDEN, INTERMEDIATE, N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    inputs: list[torch.Tensor]  # leaves; those with requires_grad get gradients in fwd+bwd
    grads: list[torch.Tensor]  # upstream gradients, one per output
    impls: dict[str, Callable]  # implementation name -> fn(*inputs) -> tensor or tuple of tensors
    bytes_fwd: int
    bytes_fwdbwd: int
    shape: str


@dataclass
class BenchOp:
    name: str
    module: str  # notebookkit module the op needs; missing -> row marked "missing"
    build: Callable[[int, torch.dtype, torch.device], Case]
    note: str = ""
    tags: list[str] = field(default_factory=list)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _leaf(shape, dtype, device, scale=1.0, grad=True):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


def _try_liger(name: str):
    try:
        return getattr(importlib.import_module("liger_kernel.transformers.functional"), name)
    except Exception:
        return None


# --------------------------------------------------------------------------------------------------
# Ops (items 1-3 of the kernel issue); other helpers append theirs to OPS below
# --------------------------------------------------------------------------------------------------
def _rms_norm_case(rows: int, cols: int, flavour: str):
    def build(tokens, dtype, device):
        from notebookkit.kernels.rms_norm import rms_norm

        n_rows = tokens * rows
        x = _leaf((n_rows, cols), dtype, device)
        w = (torch.rand(cols, device=device) + 0.5).to(dtype).requires_grad_()
        dy = torch.randn_like(x)

        def eager(x, w):
            xf = x.float()
            n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (n * (1.0 + w.float())).to(x.dtype) if flavour == "gemma" else w * n.to(x.dtype)

        impls = {"notebookkit": lambda x, w: rms_norm(x, w, 1e-6, flavour), "eager": eager}
        liger = _try_liger("liger_rms_norm")
        if liger is not None:
            impls["liger"] = lambda x, w: liger(x, w, 1e-6, 1.0 if flavour == "gemma" else 0.0, flavour)
        act = _nbytes(x)
        return Case([x, w], [dy], impls, bytes_fwd=2 * act, bytes_fwdbwd=5 * act, shape=f"[{n_rows}, {cols}]")

    return build


def _rope_build(tokens, dtype, device):
    from notebookkit.kernels.rope import apply_rope

    seq = min(tokens, 8192)
    batch = max(1, tokens // seq)
    # [B, T, H, D] projections, viewed as [B, H, T, D] as HF attention does
    q = _leaf((batch, seq, N_Q_HEADS, HEAD_DIM), dtype, device).detach().transpose(1, 2).requires_grad_()
    k = _leaf((batch, seq, N_KV_HEADS, HEAD_DIM), dtype, device).detach().transpose(1, 2).requires_grad_()
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[None].expand(batch, -1, -1)
    cos, sin = emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def rotate_half(x):
        return torch.cat((-x[..., HEAD_DIM // 2:], x[..., : HEAD_DIM // 2]), dim=-1)

    def eager(q, k):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    impls = {"notebookkit": lambda q, k: apply_rope(q, k, cos, sin), "eager": eager}
    liger = _try_liger("liger_rope")
    if liger is not None:
        impls["liger"] = lambda q, k: liger(q, k, cos, sin)
    qk = _nbytes(q, k)
    tables = _nbytes(cos, sin)
    return Case([q, k], [dq, dk], impls, bytes_fwd=2 * qk + tables, bytes_fwdbwd=4 * qk + 2 * tables,
                shape=f"q[{batch},{N_Q_HEADS},{seq},{HEAD_DIM}] k[{batch},{N_KV_HEADS},{seq},{HEAD_DIM}]")


def _glu_case(kind: str):
    def build(tokens, dtype, device):
        e = _leaf((tokens, INTERMEDIATE), dtype, device, scale=2.0)
        g = _leaf((tokens, INTERMEDIATE), dtype, device)
        dh = torch.randn_like(e)
        if kind == "swiglu":
            from notebookkit.kernels.swiglu import swiglu

            impls = {"notebookkit": swiglu, "eager": lambda e, g: F.silu(e) * g}
            liger = _try_liger("liger_swiglu")
        else:
            from notebookkit.kernels.geglu import geglu

            approx = "tanh" if kind == "geglu_tanh" else "none"
            impls = {"notebookkit": lambda e, g: geglu(e, g, approx),
                     "eager": lambda e, g: F.gelu(e, approximate=approx) * g}
            liger = _try_liger("liger_geglu") if approx == "tanh" else None  # liger has the tanh form only
        if liger is not None:
            impls["liger"] = liger
        act = _nbytes(e)
        return Case([e, g], [dh], impls, bytes_fwd=3 * act, bytes_fwdbwd=3 * act + 5 * act,
                    shape=f"[{tokens}, {INTERMEDIATE}]")

    return build


OPS: list[BenchOp] = [
    BenchOp("rms_norm", "notebookkit.kernels.rms_norm", _rms_norm_case(1, HIDDEN, "llama"), "Llama casting"),
    BenchOp("rms_norm_gemma", "notebookkit.kernels.rms_norm", _rms_norm_case(1, HIDDEN, "gemma"), "(1 + w), fp32"),
    BenchOp("qk_norm", "notebookkit.kernels.rms_norm", _rms_norm_case(N_Q_HEADS, HEAD_DIM, "llama"),
            "per-head q norm (Qwen3)"),
    BenchOp("rope", "notebookkit.kernels.rope", _rope_build, "Q and K, GQA 32/8, strided views"),
    BenchOp("swiglu", "notebookkit.kernels.swiglu", _glu_case("swiglu")),
    BenchOp("geglu", "notebookkit.kernels.geglu", _glu_case("geglu"), "exact erf"),
    BenchOp("geglu_tanh", "notebookkit.kernels.geglu", _glu_case("geglu_tanh"), "tanh approximation"),
]


# Items 4-5: cross-entropy on materialised logits and fused linear cross-entropy (Llama-3 vocabulary).
VOCAB = 128256


def _ce_labels(tokens, vocab, device):
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[::10] = -100  # some prompt/padding positions
    return labels


def _cross_entropy_build(tokens, dtype, device):
    from notebookkit.kernels.cross_entropy import cross_entropy

    x = _leaf((tokens, VOCAB), dtype, device, scale=2.0)
    labels = _ce_labels(tokens, VOCAB, device)
    impls = {
        # leaf logits: the gradient goes to a new buffer, like eager (in place only for intermediates)
        "notebookkit": lambda x: cross_entropy(x, labels),
        "eager": lambda x: F.cross_entropy(x.float(), labels, ignore_index=-100),  # HF upcasts the logits
    }
    one = torch.ones((), device=device)
    return Case([x], [one], impls, bytes_fwd=_nbytes(x), bytes_fwdbwd=2 * _nbytes(x), shape=f"[{tokens}, {VOCAB}]")


def _fused_linear_ce_build(tokens, dtype, device):
    from notebookkit.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    h = _leaf((tokens, HIDDEN), dtype, device)
    w = _leaf((VOCAB, HIDDEN), dtype, device, scale=HIDDEN**-0.5, grad=False)  # frozen lm_head (LoRA)
    labels = _ce_labels(tokens, VOCAB, device)
    impls = {
        "notebookkit": lambda h: fused_linear_cross_entropy(h, w, labels),
        "eager": lambda h: F.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100),
    }
    liger = _try_liger("liger_fused_linear_cross_entropy")
    if liger is not None:
        def liger_flce(h):
            out = liger(h, w, labels)
            return (out[0] if isinstance(out, tuple) else out).float()

        impls["liger"] = liger_flce
    one = torch.ones((), device=device)
    return Case([h], [one], impls, bytes_fwd=_nbytes(h, w), bytes_fwdbwd=2 * _nbytes(h, w) + _nbytes(h),
                shape=f"h[{tokens}, {HIDDEN}] W[{VOCAB}, {HIDDEN}]")


OPS += [
    BenchOp("cross_entropy", "notebookkit.kernels.cross_entropy", _cross_entropy_build,
            "eager = F.cross_entropy(logits.float())"),
    BenchOp("fused_linear_ce", "notebookkit.kernels.fused_linear_cross_entropy", _fused_linear_ce_build,
            "frozen lm_head; eager = lm_head + F.cross_entropy(.float()); GEMM-bound: GB/s not meaningful; "
            "target peak < 10% of fp32 logits"),
]


# Item 6: NF4 dequantisation of one Llama-3.1-8B MLP weight (forward only: the base weight is frozen).
def _nf4_build(tokens, dtype, device):
    import bitsandbytes.functional as bnbF

    from notebookkit.kernels.nf4 import dequantize_nf4, dequantize_nf4_reference

    w = (torch.randn(HIDDEN, INTERMEDIATE, device=device) * 0.02).to(dtype)
    try:
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        bnb_cuda = True
    except Exception:  # bitsandbytes without CUDA kernels: quantise on the CPU, no bitsandbytes row
        packed, qs = bnbF.quantize_4bit(w.cpu(), blocksize=64, compress_statistics=True, quant_type="nf4")
        packed = packed.to(device)
        qs.to(device)  # in place
        bnb_cuda = False
    out_bytes = _nbytes(w)
    del w
    impls = {
        "notebookkit": lambda p: dequantize_nf4(p, qs, out_dtype=dtype),
        "eager": lambda p: dequantize_nf4_reference(p, qs, out_dtype=dtype),
    }
    if bnb_cuda:
        impls["bitsandbytes"] = lambda p: bnbF.dequantize_4bit(p, qs, quant_type="nf4")
    state = _nbytes(packed, qs.absmax, qs.state2.absmax, qs.state2.code)
    return Case([packed], [], impls, bytes_fwd=state + out_bytes, bytes_fwdbwd=0,
                shape=f"W[{HIDDEN}, {INTERMEDIATE}] blocksize 64, nested absmax")


OPS += [
    BenchOp("nf4_dequant", "notebookkit.kernels.nf4", _nf4_build,
            "forward only; eager = plain-torch reference; GB/s on packed + absmax read, weight written"),
]


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------
def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _bench(fn: Callable[[], object]) -> tuple[float, str]:
    """Median GPU time of ``fn`` in ms, and how it was timed.

    Replayed from a CUDA graph where ``fn`` can be captured ("cuda graph"): an op over 8192 tokens
    runs in tens of microseconds, less than Python and autograd take to launch it, and in a real
    training step those launches overlap the GEMMs. Timing plain calls would measure the host, not
    the kernels. Falls back to ``do_bench`` (launch overhead included) when capture fails:
    "do_bench (<why capture failed>)".
    """
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=200, return_mode="median")), "cuda graph"
    except Exception as exc:
        torch.cuda.synchronize()
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}" if str(exc) else type(exc).__name__
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median")), f"do_bench ({why})"


def _peak_mib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2**20


def copy_bandwidth_gbps(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time), the ceiling for memory-bound ops."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    from triton.testing import do_bench

    # One 1 GiB copy runs ~0.5 ms, far above launch overhead: time it plainly (in a CUDA graph the
    # copy node took a slower path on the H200, 2.8 vs 4.2 TB/s, which would flatter every ratio).
    ms = float(do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median"))
    del src, dst
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def _rel_err(out, ref) -> float:
    """Largest ``||out - ref|| / ||ref||`` over the outputs; NaN when an output is not finite."""
    errs = []
    for a, b in zip(_as_tuple(out), _as_tuple(ref)):
        a64, b64 = a.detach().double(), b.detach().double()
        if not torch.isfinite(a64).all():
            return math.nan
        errs.append(((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item())
    return max(errs)


def error_status(err: float, dtype: torch.dtype) -> str:
    """"ok" when the error against eager is finite and within the dtype's kernel tolerance, else
    "wrong: ..." (NaN never passes)."""
    from notebookkit.kernels.testing import TOLERANCE

    bound = TOLERANCE[dtype]
    if err <= bound:  # False for NaN
        return "ok"
    return f"wrong: rel err {err:.1e} vs eager > {bound:.0e}" if math.isfinite(err) else \
        f"wrong: rel err {err} vs eager (non-finite output or error)"


def run_op(op: BenchOp, tokens: int, dtype: torch.dtype, copy_gbps: float, use_compile: bool) -> list[dict]:
    base = dict(op=op.name, note=op.note, dtype=str(dtype).replace("torch.", ""), tokens=tokens)
    try:
        importlib.import_module(op.module)
    except Exception as exc:
        return [base | dict(impl="notebookkit", status=f"missing ({type(exc).__name__}: {exc})"[:200])]
    try:
        case = op.build(tokens, dtype, torch.device("cuda"))
    except Exception as exc:
        return [base | dict(impl="-", status=f"build failed: {type(exc).__name__}: {exc}"[:300])]
    impls = dict(case.impls)
    if use_compile and "eager" in impls:
        try:
            impls["torch.compile"] = torch.compile(impls["eager"])
        except Exception as exc:
            impls["torch.compile"] = exc
    with torch.no_grad():
        reference = _as_tuple(impls["eager"](*case.inputs))
    diff_inputs = [t for t in case.inputs if t.requires_grad]
    rows = []
    for name, fn in impls.items():
        row = base | dict(impl=name, shape=case.shape)
        if isinstance(fn, Exception):
            rows.append(row | dict(status=f"failed: {type(fn).__name__}: {fn}"[:300]))
            continue
        try:
            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(*case.inputs)

            def fwdbwd(fn=fn):
                out = _as_tuple(fn(*case.inputs))
                return torch.autograd.grad(out, diff_inputs, case.grads)

            err = _rel_err(fwd(), reference)
            status = error_status(err, dtype)
            if not diff_inputs:  # forward-only op (NF4 dequant of a frozen weight): no fwd+bwd columns
                t_fwd, how_fwd = _bench(fwd)
                gbs_fwd = case.bytes_fwd / (t_fwd * 1e-3) / 1e9
                row |= dict(status=status, fwd_ms=t_fwd, fwd_timing=how_fwd, fwd_gbps=gbs_fwd,
                            fwd_pct_copy=100 * gbs_fwd / copy_gbps, peak_fwd_mib=_peak_mib(fwd), rel_err_vs_eager=err)
                rows.append(row)
                torch.cuda.empty_cache()
                continue
            fwdbwd()  # warm-up (compiles the backward too)
            (t_fwd, how_fwd), (t_all, how_all) = _bench(fwd), _bench(fwdbwd)
            gbs_fwd = case.bytes_fwd / (t_fwd * 1e-3) / 1e9
            gbs_all = case.bytes_fwdbwd / (t_all * 1e-3) / 1e9
            row |= dict(
                status=status, fwd_ms=t_fwd, fwdbwd_ms=t_all, fwd_timing=how_fwd, fwdbwd_timing=how_all,
                fwd_gbps=gbs_fwd, fwdbwd_gbps=gbs_all,
                fwd_pct_copy=100 * gbs_fwd / copy_gbps, fwdbwd_pct_copy=100 * gbs_all / copy_gbps,
                peak_fwd_mib=_peak_mib(fwd), peak_fwdbwd_mib=_peak_mib(fwdbwd), rel_err_vs_eager=err,
            )
        except Exception as exc:
            oom = isinstance(exc, torch.cuda.OutOfMemoryError)
            row |= dict(status="out of memory" if oom else f"failed: {type(exc).__name__}: {exc}"[:300])
            if not oom:
                traceback.print_exc()
        rows.append(row)
        torch.cuda.empty_cache()
    eager = next((r for r in rows if r["impl"] == "eager" and r.get("status") == "ok"), None)
    for r in rows:
        if eager and r.get("status") == "ok":
            r["speedup_fwd"] = eager["fwd_ms"] / r["fwd_ms"]
            if "fwdbwd_ms" in r:
                r["speedup_fwdbwd"] = eager["fwdbwd_ms"] / r["fwdbwd_ms"]
    del case
    torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------
def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def _timing_cell(row: dict) -> str:
    """"graph" / "do_bench" per timed pass (fwd, fwd+bwd); "–" for rows that were not timed."""
    short = lambda how: "–" if how is None else ("graph" if how == "cuda graph" else "do_bench")  # noqa: E731
    if "fwd_timing" not in row:
        return "–"
    return short(row["fwd_timing"]) + ("" if "fwdbwd_timing" not in row else f" / {short(row['fwdbwd_timing'])}")


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Kernel benchmark: {meta['gpu']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; {meta['dtype']}, "
        f"{meta['tokens']} tokens, Llama-3.1-8B layer (hidden {HIDDEN}, intermediate {INTERMEDIATE}, "
        f"{N_Q_HEADS}/{N_KV_HEADS} heads, head_dim {HEAD_DIM}).",
        f"Device-to-device copy: **{meta['copy_gbps']:.0f} GB/s** (read + write). GB/s below = ideal bytes of "
        "the op (inputs read once, outputs written once) / median time; % = of that copy bandwidth. "
        "Peak = memory allocated on top of the inputs. Speed-up = eager time / this time. Timed by: `graph` = "
        "replayed from a CUDA graph (launch overhead excluded), `do_bench` = plain calls where capture failed "
        "(launch overhead included; the JSON says why), for fwd / fwd+bwd. Status `ok` needs a finite error "
        "against eager within the dtype's kernel tolerance; NaN or more is `wrong`.",
        "",
        "| op | shape | dtype | impl | fwd ms | fwd GB/s | fwd % copy | fwd+bwd ms | fwd+bwd GB/s | fwd+bwd % copy "
        "| speed-up fwd | speed-up fwd+bwd | peak fwd MiB | peak fwd+bwd MiB | rel err vs eager | timed by | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r.get('shape', '')} | {r['dtype']} | {r['impl']} | {_fmt(r.get('fwd_ms'), '.3f')} "
            f"| {_fmt(r.get('fwd_gbps'), '.0f')} | {_fmt(r.get('fwd_pct_copy'), '.0f')} "
            f"| {_fmt(r.get('fwdbwd_ms'), '.3f')} | {_fmt(r.get('fwdbwd_gbps'), '.0f')} "
            f"| {_fmt(r.get('fwdbwd_pct_copy'), '.0f')} | {_fmt(r.get('speedup_fwd'), '.2f')} "
            f"| {_fmt(r.get('speedup_fwdbwd'), '.2f')} | {_fmt(r.get('peak_fwd_mib'), '.0f')} "
            f"| {_fmt(r.get('peak_fwdbwd_mib'), '.0f')} | {_fmt(r.get('rel_err_vs_eager'), '.1e')} "
            f"| {_timing_cell(r)} | {r.get('status', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="notebookkit kernel benchmark (GPU)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the .json and .md")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all); --list shows them")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    if args.list:
        for op in OPS:
            print(f"{op.name:20s} {op.module:40s} {op.note}")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (run it on the GPU machine).", file=sys.stderr)
        return 2
    wanted = {s.strip() for s in args.ops.split(",") if s.strip()}
    unknown = wanted - {op.name for op in OPS}
    if unknown:
        print(f"unknown ops {sorted(unknown)}; known: {[op.name for op in OPS]}", file=sys.stderr)
        return 2
    import triton

    dtype = DTYPES[args.dtype]
    gpu = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth_gbps()
    meta = dict(
        date=dt.date.today().isoformat(), gpu=gpu, torch=torch.__version__, triton=triton.__version__,
        cuda=torch.version.cuda, python=platform.python_version(), dtype=args.dtype, tokens=args.tokens,
        copy_gbps=copy_gbps,
    )
    rows = []
    for op in OPS:
        if wanted and op.name not in wanted:
            continue
        torch.manual_seed(0)
        op_rows = run_op(op, args.tokens, dtype, copy_gbps, not args.no_compile)
        for r in op_rows:
            print(json.dumps(r), flush=True)
        rows.extend(op_rows)
    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stem = os.path.join(args.out, f"{meta['date']}-{slug}-kernels")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = markdown(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
