"""Reload what an export wrote and compare it with the adapter model on a fixed prompt set.

* Merged Hugging Face folder: reloaded with plain ``transformers.AutoModelForCausalLM`` (fp32, on
  the CPU, so the check measures the written weights, not the reload's arithmetic). The largest
  logit difference against the adapter model, relative to the largest logit, must stay within
  the written dtype's tolerance: ``2^-6`` for bf16 (8 significant bits), ``2^-9`` for fp16, ``1e-5``
  for fp32 (reassociation only: ``x W^T + s (x A^T) B^T`` against ``x (W + s B A)^T``), plus twice
  the adapter model's own arithmetic noise where it computes in 16-bit (on a GPU): measured by
  running the reloaded model in that dtype on that device against its fp32 logits. Greedy
  continuations are compared too.
* A ``merged_4bit_forced`` folder (its config carries a ``quantization_config``) is reloaded by
  ``transformers`` + ``bitsandbytes`` in 4-bit, its layers decoded by notebookkit in fp32 (never by
  bitsandbytes' CPU decode). NF4 rounding has no tolerance to meet, so its logit difference is
  stated; what must hold is that the loaded 4-bit weights decode to exactly the NF4 quantisation of
  the merged weights (``weights_exact``: the merge re-quantised afresh, decoded, compared bit for bit).
* GGUF: loaded in llama.cpp through ``llama-cpp-python`` (fp32 KV cache); the logits along Hugging
  Face's greedy path (teacher-forced) within the format's tolerance (``GGUF_TOLERANCE``), llama.cpp's
  tokenization of the prompts, and the free-running greedy continuations (16 tokens). Where those
  part, it is said whether that is a near-tie the format explains: the same tokens are run through
  a Hugging Face model whose weights are rounded as the file stores them
  (:mod:`notebookkit.export.gguf_rounding`), which measures the format's own rounding without
  llama.cpp; llama.cpp's difference must stay within ``ROUNDING_FACTOR`` times that plus llama.cpp's
  arithmetic (measured on the f32 file), and Hugging Face's own gap between the two tokens where a
  continuation parts must be below twice the difference so explained at that step
  (:meth:`GGUFCheck.explained`). A wrong layout or a misplaced tensor changes llama.cpp's logits far
  more than the rounding does and fails it.

Prompts are chat turns rendered with the tokenizer's own template and generation prompt, so the
check exercises the same template that training and serving use.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from notebookkit.export_forms import GGUF_TYPES

__all__ = [
    "FIXED_QUESTIONS", "MERGED_TOLERANCE", "prompt_ids", "adapter_logits", "greedy_hf",
    "MergedCheck", "check_merged_folder", "reload_merged_folder", "is_4bit_folder", "GGUFCheck", "GGUF_TOLERANCE", "ROUNDING_FACTOR", "Divergence", "check_gguf_file", "greedy_llama_cpp",
    "CHECKS",
]

FIXED_QUESTIONS: tuple[str, ...] = (
    "What is the capital of the northern province?",
    "Name three things a baker sells.",
    "Write one sentence about the river.",
    "How many legs does a spider have?",
)

MERGED_TOLERANCE = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 1e-5}


def prompt_ids(tokenizer: Any, questions: Sequence[str] = FIXED_QUESTIONS) -> list[list[int]]:
    """Token ids of each question as one user turn plus the generation prompt, in the chat template."""
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def _device_of(model: nn.Module) -> torch.device:
    return next(p.device for p in model.parameters())


@torch.no_grad()
def adapter_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[T, V]`` of one prompt (eval mode, no cache)."""
    was_training = model.training
    model.eval()
    try:
        x = torch.tensor([ids], device=_device_of(model))
        return model(input_ids=x, use_cache=False).logits[0].float().cpu()
    finally:
        model.train(was_training)


@torch.no_grad()
def greedy_hf(model: nn.Module, ids: list[int], n_tokens: int = 16) -> list[int]:
    """Greedy continuation (argmax of each step's logits, full recompute: no cache subtleties)."""
    was_training = model.training
    model.eval()
    try:
        seq = list(ids)
        device = _device_of(model)
        for _ in range(n_tokens):
            logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0, -1]
            seq.append(int(torch.argmax(logits.float())))
        return seq[len(ids):]
    finally:
        model.train(was_training)


@dataclass
class MergedCheck:
    """The merged folder against the adapter model on the fixed prompts."""

    max_abs_diff: float
    relative_diff: float  # max |diff| / max |logit|
    tolerance: Optional[float]  # None for the 4-bit form: its difference is stated, not bounded
    greedy_equal: int
    prompts: int
    dtype: str
    weights_exact: Optional[bool] = None  # 4-bit form: the loaded weights are the merge's NF4 quantisation
    compute_noise: float = 0.0  # relative: the merged model in the adapter's compute dtype/device against fp32

    @property
    def ok(self) -> bool:
        """Within the written dtype's tolerance, plus twice the measured noise of the adapter model's
        own 16-bit arithmetic (a bf16 GPU model is compared with an fp32 CPU reload)."""
        finite = bool(np.isfinite(self.relative_diff))
        if self.tolerance is None:
            return finite and bool(self.weights_exact)
        return finite and self.relative_diff <= self.tolerance + 2 * self.compute_noise


def is_4bit_folder(folder: os.PathLike) -> bool:
    """Whether an exported folder holds bitsandbytes 4-bit weights (``merged_4bit_forced``)."""
    import json

    config = json.loads((Path(folder) / "config.json").read_text())
    return bool((config.get("quantization_config") or {}).get("load_in_4bit"))


def reload_merged_folder(folder: os.PathLike) -> nn.Module:
    """The exported folder in plain transformers, fp32 on the CPU. A 4-bit folder is loaded by
    bitsandbytes as it is and its layers are decoded by notebookkit in fp32 (bitsandbytes' CPU
    decode is wrong on AVX-512 CPUs)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu")
    if is_4bit_folder(folder):
        from notebookkit.base_layers.linear4bit import is_linear4bit, patch_linear4bit

        patch_linear4bit(reloaded)
        for module in reloaded.modules():
            if is_linear4bit(module):
                module.compute_dtype, module.compute_type_is_set = torch.float32, True
    return reloaded.eval()


def _nf4_weights_exact(model: nn.Module, reloaded: nn.Module) -> bool:
    """Every 4-bit layer of ``reloaded`` decodes to exactly the NF4 quantisation of ``model``'s merged weight
    (merged and quantised again on the model's device, as the export did unless its budget sent a
    tensor to the CPU)."""
    from notebookkit.kernels.nf4 import dequantize_nf4
    from notebookkit.base_layers.linear4bit import is_linear4bit

    from .merge import plan_merged_tensors
    from .nf4_quantize import quantize_nf4

    merged = {t.name: t for t in plan_merged_tensors(model, torch.float32) if t.linear_rank is not None}
    loaded = [(name, m) for name, m in reloaded.named_modules() if is_linear4bit(m)]
    if not loaded:
        return False
    for name, module in loaded:
        planned = merged.get(name + ".weight")
        if planned is None:
            return False
        q = quantize_nf4(planned.make(planned.source_device))  # where the export merged it, for the same bits
        want = dequantize_nf4(q.packed, q, out_dtype=torch.float32).cpu()
        got = dequantize_nf4(module.weight, module.weight.quant_state, out_dtype=torch.float32)
        if want.shape != got.shape or not torch.equal(want, got):
            return False
    return True


def check_merged_folder(model: nn.Module, folder: os.PathLike, tokenizer: Any, n_tokens: int = 16) -> MergedCheck:
    """Reload ``folder`` with plain transformers (fp32, CPU) and compare with ``model``."""
    import json

    config = json.loads((Path(folder) / "config.json").read_text())
    four_bit = is_4bit_folder(folder)
    dtype = getattr(torch, str(config.get("dtype", "float32")).replace("torch.", ""), torch.float32)
    reloaded = reload_merged_folder(folder)
    worst = scale = 0.0
    equal = 0
    prompts = prompt_ids(tokenizer)
    exact_logits = []
    for ids in prompts:
        a = adapter_logits(model, ids)
        b = adapter_logits(reloaded, ids)
        exact_logits.append(b)
        worst = max(worst, float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
        equal += greedy_hf(model, ids, n_tokens) == greedy_hf(reloaded, ids, n_tokens)
    exact = _nf4_weights_exact(model, reloaded) if four_bit else None
    noise = 0.0 if four_bit else _compute_noise(model, reloaded, prompts, exact_logits)
    del reloaded
    rel = worst / scale if scale > 0 else float("nan")
    tolerance = None if four_bit else MERGED_TOLERANCE.get(dtype, 2.0**-6)
    return MergedCheck(worst, rel, tolerance, equal, len(prompts), "nf4" if four_bit else str(dtype).replace("torch.", ""), exact,
                       noise / scale if scale > 0 else 0.0)


def _compute_noise(model: nn.Module, reloaded: nn.Module, prompts: list[list[int]], exact_logits: list[torch.Tensor]) -> float:
    """Largest logit change from running the merged model in ``model``'s compute dtype on its device
    instead of fp32 on the CPU: the adapter model's own arithmetic noise, measured (0 for an fp32
    CPU model). ``reloaded`` is moved there (it is not needed in fp32 afterwards)."""
    from .merged import model_dtype

    dtype, device = model_dtype(model), _device_of(model)
    if dtype == torch.float32 and device.type == "cpu":
        return 0.0
    reloaded.to(device=device, dtype=dtype)
    return max(float((adapter_logits(reloaded, ids) - b).abs().max()) for ids, b in zip(prompts, exact_logits))


@contextlib.contextmanager
def _without_weight_repacking(llama_cpp: Any):
    """Load models without llama.cpp's CPU weight repacking (``use_extra_bufts = False``).

    Repacking re-lays quantised weights for the CPU's fastest kernels (AMX tiles, interleaved
    Q4_0/Q8_0 blocks), picked from the CPU's flags; where the operating system does not grant AMX
    (seen in a sandbox on a Sapphire Rapids CPU) the process dies with SIGILL on the first Q8_0
    product. The check measures the file, not llama.cpp's kernels, so it loads without repacking
    (``NOTEBOOKKIT_LLAMA_REPACK=1`` keeps it). ``Llama()`` takes no argument for it, so the default
    parameters it starts from are swapped for the duration of the load only.
    """
    if os.environ.get("NOTEBOOKKIT_LLAMA_REPACK", "0") == "1":
        yield
        return
    from llama_cpp import llama as llama_module

    original = llama_module.llama_cpp.llama_model_default_params

    def defaults():
        params = original()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = defaults
    try:
        yield
    finally:
        llama_module.llama_cpp.llama_model_default_params = original


GGML_TYPE_F32 = 0


def load_llama_cpp(path: os.PathLike, n_ctx: int = 512):
    """The file in llama.cpp on the CPU, for checks: an fp32 KV cache (llama.cpp's default f16 cache
    rounds keys and values; the check measures the file), no weight repacking, all logits kept, no
    layer offloaded (``n_gpu_layers=0``: a CUDA build of llama-cpp-python computes the same on the CPU)."""
    from .kquants import require_llama_cpp

    llama_cpp = require_llama_cpp(purpose="Verifying a GGUF export")
    threads = max(1, min(8, (os.cpu_count() or 2) // 2))  # 1 on a 2-core CI machine
    with _without_weight_repacking(llama_cpp):
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_batch=n_ctx, verbose=False, seed=0,
                               logits_all=True, n_gpu_layers=0, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)


def greedy_llama_cpp(llm: Any, ids: list[int], n_tokens: int = 16) -> tuple[list[int], np.ndarray]:
    """Greedy continuation in llama.cpp of the same token ids, and its first-step logits."""
    llm.reset()
    llm.eval(list(ids))
    first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    out = [int(np.argmax(first))]
    for _ in range(n_tokens - 1):
        llm.eval([out[-1]])
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    return out, first


#: Largest teacher-forced logit difference (llama.cpp against Hugging Face in fp32), relative to the
#: largest logit, that each GGUF format is held to: the format's weight rounding plus llama.cpp's own
#: activation rounding (its CPU products round activations to f16 / bf16 / q8 blocks). An f32 file has
#: no weight rounding, but llama.cpp evaluates GELU (Gemma) through an f16 table: 2 ulps of f16.
#: The numbers are the ``tolerance`` of each type's row in :data:`notebookkit.export_forms.GGUF_TYPES`.
GGUF_TOLERANCE = {t.name: t.tolerance for t in GGUF_TYPES.values()}

#: How much larger llama.cpp's logit difference may be than the format's weight rounding alone
#: explains (:mod:`notebookkit.export.gguf_rounding`, measured in Hugging Face's fp32 arithmetic):
#: llama.cpp also rounds the activations to the same precision (f16 for F16, bf16 for BF16, q8_0
#: blocks for Q8_0; finer for Q4_0 and the K-quants), so about twice; measured on the tiny models of
#: every family and format, 1.0x-1.8x over a prompt and at most 2.6x at one step. 3 leaves that margin.
ROUNDING_FACTOR = 3.0


@dataclass
class Divergence:
    """Where a free-running llama.cpp continuation first differs from Hugging Face's (same context up to there)."""

    prompt: int
    step: int
    hf_gap: float  # HF's logit of its own token minus its logit of llama.cpp's token (>= 0)
    bound: float  # 2 x (ROUNDING_FACTOR x format rounding + llama.cpp's arithmetic) at this step

    @property
    def near_tie(self) -> bool:
        return bool(np.isfinite(self.hf_gap)) and self.hf_gap <= self.bound


@dataclass
class GGUFCheck:
    """A GGUF file in llama.cpp against Hugging Face on the fixed prompts.

    Per step of Hugging Face's greedy path (teacher-forced, same tokens for both): ``step_diff`` is
    ``max |llama.cpp logits - HF logits|`` and ``format_diff`` the same for the model whose weights are
    rounded as the file stores them (:func:`notebookkit.export.gguf_rounding.rounded_reference_model`),
    i.e. the difference the format's weight rounding alone makes, measured without llama.cpp.
    """

    path: Path
    greedy_equal: int  # prompts whose free-running greedy continuations are equal
    prompts: int
    max_abs_diff: float  # teacher-forced along Hugging Face's greedy path
    relative_diff: float  # max_abs_diff / max |logit|
    tokens_agree: int = 0  # common-prefix length of the continuations, summed over prompts
    tokens_total: int = 0
    tokenizer_equal: bool = True  # llama.cpp's tokenizer gives Hugging Face's ids for every prompt
    continuations: list = field(default_factory=list)
    method: Optional[str] = None
    scale: float = 0.0  # max |HF logit|
    step_diff: list = field(default_factory=list)  # per prompt: np.ndarray of per-step llama.cpp differences
    format_diff: list = field(default_factory=list)  # per prompt: per-step differences of the rounded weights
    first_divergence: list = field(default_factory=list)  # per prompt: (step, HF gap) or None

    @property
    def agreement(self) -> float:
        return self.tokens_agree / max(self.tokens_total, 1)

    def within(self, method: str) -> bool:
        return bool(np.isfinite(self.relative_diff)) and self.relative_diff <= GGUF_TOLERANCE[method]

    def _floor(self, arithmetic: Optional["GGUFCheck"], p: int) -> np.ndarray:
        """llama.cpp's own arithmetic at each step: the f32 file's differences (no weight rounding), or
        the f32 tolerance where no f32 file was checked."""
        if arithmetic is not None:
            return np.asarray(arithmetic.step_diff[p])
        return np.full(len(self.step_diff[p]), GGUF_TOLERANCE["f32"] * self.scale)

    def divergences(self, arithmetic: Optional["GGUFCheck"] = None) -> list[Divergence]:
        """Each prompt's first divergence with its bound (needs ``format_diff``)."""
        out = []
        for p, hit in enumerate(self.first_divergence):
            if hit is not None:
                step, gap = hit
                bound = 2 * (ROUNDING_FACTOR * self.format_diff[p][step] + self._floor(arithmetic, p)[step])
                out.append(Divergence(p, step, gap, float(bound)))
        return out

    def explained_bound(self, arithmetic: Optional["GGUFCheck"] = None) -> float:
        """``ROUNDING_FACTOR x`` the format's largest difference plus llama.cpp's largest arithmetic one."""
        fmt = max(float(np.max(d)) for d in self.format_diff)
        floor = max(float(np.max(self._floor(arithmetic, p))) for p in range(len(self.step_diff)))
        return ROUNDING_FACTOR * fmt + floor

    def explained(self, arithmetic: Optional["GGUFCheck"] = None) -> bool:
        """llama.cpp differs from Hugging Face no more than the format's rounding explains, and each
        continuation parts only at a near-tie: where Hugging Face's own gap between the two tokens is
        below twice the difference the rounding explains at that step. ``arithmetic``: the check of
        the f32 file of the same model (llama.cpp's arithmetic without weight rounding)."""
        if not self.format_diff:
            raise ValueError("this check ran without the rounded reference (check_gguf_file(..., method=...))")
        ok = bool(np.isfinite(self.max_abs_diff)) and self.max_abs_diff <= self.explained_bound(arithmetic)
        return ok and all(d.near_tie for d in self.divergences(arithmetic))

    def summary(self, arithmetic: Optional["GGUFCheck"] = None) -> str:
        """One line of numbers: differences, the explained bound, greedy agreement and each divergence."""
        text = (f"{self.method}: llama.cpp rel {self.relative_diff:.2e} (abs {self.max_abs_diff:.2e}), equal "
                f"{self.greedy_equal}/{self.prompts}, agreement {self.agreement:.2f}")
        if self.format_diff and self.method != "f32":  # f32: no weight rounding; it is the arithmetic floor
            fmt = max(float(np.max(d)) for d in self.format_diff)
            text += f"; format rounding abs {fmt:.2e}, explained bound {self.explained_bound(arithmetic):.2e}"
            for d in self.divergences(arithmetic):
                text += f"; prompt {d.prompt} parts at step {d.step}: HF gap {d.hf_gap:.4f} vs bound {d.bound:.4f}"
        return text


def _method_of(path: Path) -> Optional[str]:
    name = path.name.lower()
    return next((m for m in GGUF_TOLERANCE if name.endswith(f".{m}.gguf")), None)


def check_gguf_file(model: nn.Module, path: os.PathLike, tokenizer: Any, n_tokens: int = 16, method: Optional[str] = None,
                    rounding_reference: bool = True) -> GGUFCheck:
    """Load ``path`` in llama.cpp and compare it with ``model`` on the fixed prompts: logits along
    Hugging Face's greedy path (teacher-forced), free-running greedy continuations, tokenization;
    with ``rounding_reference``, also the model with the format's rounded weights in Hugging Face
    (``method``: the file's format, read from its name when not given)."""
    path = Path(path)
    method = method or _method_of(path)
    reference = None
    if rounding_reference and method is not None:
        from .gguf_rounding import rounded_reference_model

        reference = rounded_reference_model(model, method, path)
    llm = load_llama_cpp(path)
    try:
        check = GGUFCheck(path, 0, 0, 0.0, float("nan"), method=method)
        for q, ids in zip(FIXED_QUESTIONS, prompt_ids(tokenizer)):
            text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            check.tokenizer_equal &= llm.tokenize(text.encode(), add_bos=False, special=True) == ids
            hf = greedy_hf(model, ids, n_tokens)
            path_ids = ids + hf[:-1]
            ref = adapter_logits(model, path_ids)[len(ids) - 1:].numpy()
            llm.reset()
            llm.eval(path_ids)
            cpp_logits = np.array(llm.scores[len(ids) - 1: len(path_ids)], dtype=np.float32)[:, : ref.shape[1]]
            check.step_diff.append(np.abs(cpp_logits - ref).max(axis=1))
            if reference is not None:
                rounded = adapter_logits(reference, path_ids)[len(ids) - 1:].numpy()
                check.format_diff.append(np.abs(rounded - ref).max(axis=1))
            check.max_abs_diff = max(check.max_abs_diff, float(check.step_diff[-1].max()))
            check.scale = max(check.scale, float(np.abs(ref).max()))
            cpp, _ = greedy_llama_cpp(llm, ids, n_tokens)
            check.greedy_equal += hf == cpp
            first = next((i for i, (a, b) in enumerate(zip(hf, cpp)) if a != b), len(hf))
            check.tokens_agree += first
            check.tokens_total += len(hf)
            # same context up to the first difference: how close Hugging Face's own choice was there
            check.first_divergence.append((first, float(ref[first, hf[first]] - ref[first, cpp[first]])) if first < len(hf) else None)
            check.continuations.append((hf, cpp))
        check.prompts = len(check.continuations)
        check.relative_diff = check.max_abs_diff / check.scale if check.scale > 0 else float("nan")
        return check
    finally:
        if hasattr(llm, "close"):
            llm.close()


#: The reload check of each export form, by the ``check`` of its row in :mod:`notebookkit.export_forms`.
CHECKS = {"merged_folder": check_merged_folder, "gguf_file": check_gguf_file}
