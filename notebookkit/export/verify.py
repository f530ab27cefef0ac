"""Reload what an export wrote and compare it with the adapter model on a fixed prompt set.

* Merged Hugging Face folder: reloaded with plain ``transformers.AutoModelForCausalLM`` (fp32, on
  the CPU, so the check measures the written weights, not the reload's arithmetic). The largest
  logit difference against the adapter model, relative to the largest logit, must stay within
  the written dtype's tolerance: ``2^-6`` for bf16 (8 significant bits), ``2^-9`` for fp16, ``1e-5``
  for fp32 (reassociation only: ``x W^T + s (x A^T) B^T`` against ``x (W + s B A)^T``). Greedy
  continuations are compared too.
* A ``merged_4bit_forced`` folder (its config carries a ``quantization_config``) is reloaded by
  ``transformers`` + ``bitsandbytes`` in 4-bit, its layers decoded by notebookkit in fp32 (never by
  bitsandbytes' CPU decode). NF4 rounding has no tolerance to meet, so its logit difference is
  stated; what must hold is that the loaded 4-bit weights decode to exactly the NF4 quantisation of
  the merged weights (``weights_exact``: the merge re-quantised afresh, decoded, compared bit for bit).
* GGUF: loaded in llama.cpp through ``llama-cpp-python``; greedy continuations of the same token
  ids against Hugging Face's (16 tokens), and the largest first-step logit difference.

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

__all__ = [
    "FIXED_QUESTIONS", "MERGED_TOLERANCE", "prompt_ids", "adapter_logits", "greedy_hf",
    "MergedCheck", "check_merged_folder", "reload_merged_folder", "is_4bit_folder", "GGUFCheck", "GGUF_TOLERANCE", "check_gguf_file", "greedy_llama_cpp",
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

    @property
    def ok(self) -> bool:
        finite = bool(np.isfinite(self.relative_diff))
        if self.tolerance is None:
            return finite and bool(self.weights_exact)
        return finite and self.relative_diff <= self.tolerance


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
        from notebookkit.models.patch_linear4bit import is_linear4bit, patch_linear4bit

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
    from notebookkit.models.patch_linear4bit import is_linear4bit

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
    for ids in prompts:
        a = adapter_logits(model, ids)
        b = adapter_logits(reloaded, ids)
        worst = max(worst, float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
        equal += greedy_hf(model, ids, n_tokens) == greedy_hf(reloaded, ids, n_tokens)
    exact = _nf4_weights_exact(model, reloaded) if four_bit else None
    del reloaded
    rel = worst / scale if scale > 0 else float("nan")
    tolerance = None if four_bit else MERGED_TOLERANCE.get(dtype, 2.0**-6)
    return MergedCheck(worst, rel, tolerance, equal, len(prompts), "nf4" if four_bit else str(dtype).replace("torch.", ""), exact)


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


def _llama(path: os.PathLike, n_ctx: int = 512):
    from .kquants import require_llama_cpp

    llama_cpp = require_llama_cpp(["GGUF verification"])
    with _without_weight_repacking(llama_cpp):
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, n_batch=n_ctx, verbose=False, seed=0, logits_all=True)


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
#: activation rounding (its CPU products round activations to f16 / bf16 / q8 blocks).
GGUF_TOLERANCE = {"f32": 2.0**-12, "f16": 2.0**-8, "bf16": 2.0**-5, "q8_0": 2.0**-4,
                  "q4_0": 2.0**-1, "q6_k": 2.0**-4, "q5_k_m": 2.0**-3, "q4_k_m": 2.0**-2}


@dataclass
class GGUFCheck:
    """A GGUF file in llama.cpp against Hugging Face on the fixed prompts."""

    path: Path
    greedy_equal: int  # prompts whose free-running greedy continuations are equal
    prompts: int
    max_abs_diff: float  # teacher-forced along Hugging Face's greedy path
    relative_diff: float  # max_abs_diff / max |logit|
    tokens_agree: int = 0  # common-prefix length of the continuations, summed over prompts
    tokens_total: int = 0
    tokenizer_equal: bool = True  # llama.cpp's tokenizer gives Hugging Face's ids for every prompt
    continuations: list = field(default_factory=list)
    divergence_margins: list = field(default_factory=list)  # HF logit margin where a continuation first differs

    @property
    def agreement(self) -> float:
        return self.tokens_agree / max(self.tokens_total, 1)

    def within(self, method: str) -> bool:
        return bool(np.isfinite(self.relative_diff)) and self.relative_diff <= GGUF_TOLERANCE[method]


def check_gguf_file(model: nn.Module, path: os.PathLike, tokenizer: Any, n_tokens: int = 16) -> GGUFCheck:
    """Load ``path`` in llama.cpp and compare it with ``model`` on the fixed prompts: logits along
    Hugging Face's greedy path (teacher-forced), free-running greedy continuations, tokenization."""
    llm = _llama(path)
    try:
        equal = agree = total = 0
        worst = scale = 0.0
        tokenizer_equal = True
        conts, margins = [], []
        for q, ids in zip(FIXED_QUESTIONS, prompt_ids(tokenizer)):
            text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            tokenizer_equal &= llm.tokenize(text.encode(), add_bos=False, special=True) == ids
            hf = greedy_hf(model, ids, n_tokens)
            path_ids = ids + hf[:-1]
            ref = adapter_logits(model, path_ids)[len(ids) - 1:].numpy()
            llm.reset()
            llm.eval(path_ids)
            cpp_logits = np.array(llm.scores[len(ids) - 1: len(path_ids)], dtype=np.float32)[:, : ref.shape[1]]
            worst = max(worst, float(np.abs(cpp_logits - ref).max()))
            scale = max(scale, float(np.abs(ref).max()))
            cpp, _ = greedy_llama_cpp(llm, ids, n_tokens)
            equal += hf == cpp
            first = next((i for i, (a, b) in enumerate(zip(hf, cpp)) if a != b), len(hf))
            agree += first
            if first < len(hf):  # same context up to here: how close HF's own choice was
                margins.append(float(ref[first, hf[first]] - ref[first, cpp[first]]))
            total += len(hf)
            conts.append((hf, cpp))
        rel = worst / scale if scale > 0 else float("nan")
        return GGUFCheck(Path(path), equal, len(conts), worst, rel, agree, total, tokenizer_equal, conts, margins)
    finally:
        if hasattr(llm, "close"):
            llm.close()
