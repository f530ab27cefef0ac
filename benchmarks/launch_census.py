"""Kernel launches of one step, counted on the CPU: a host-bound step (a small model or a mixture of experts on a fast
card, a decode step) costs about its launches, and this counts them without a GPU.

    TRITON_INTERPRET=1 python benchmarks/launch_census.py train --model notebookkit/tiny-qwen3_moe --dtype bfloat16
    TRITON_INTERPRET=1 python benchmarks/launch_census.py train --model notebookkit/tiny-qwen3_moe --grouped-mm
    TRITON_INTERPRET=1 python benchmarks/launch_census.py decode --model notebookkit/tiny-llama
    TRITON_INTERPRET=1 python benchmarks/launch_census.py vision --model notebookkit/tiny-qwen2.5-vl --dtype bfloat16

notebookkit's Triton kernels are forced on (``use_triton(True)``: the interpreter runs them), so the step takes
the path it takes on a GPU. One launch is counted for:

* each Triton kernel launch (the interpreter's own tensor work inside it is not counted);
* each aten op that launches a CUDA kernel; views, metadata, allocations and host scalars (:data:`NO_KERNEL`) count
  nothing.

On a GPU a few ops launch more than one kernel (``grouped_mm``: a preparation kernel and the GEMM; a sort: one pass
a key byte) and a host-to-device copy counts where the CPU sees none, so the numbers compare designs, not GPU
traces. ``train``: one LoRA step (forward and backward, the second step; LoRA r=8 on the family's default targets,
no checkpointing), ``--grouped-mm`` takes the experts' ``grouped_mm`` path (bf16 sm_90's; CPU's loop).
``decode``: one decode step (the model's ``cached_forward`` for one new token, sampling left out), NF4 base
(``--16bit``: the 16-bit base, GRPO's generation). ``vision``: one training step of a vision-language model, NF4,
LoRA on both towers, checkpointing on, two captioned images (the layer count is the decoder's). ``--lora-alpha``: LoRA's alpha at r = 8 (the default 16 scales
the adapters by 2; 8 is the benchmarks' alpha = r).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

#: aten ops that launch no kernel on a GPU (views, metadata, allocations, host reads)
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select", "slice",
    "as_strided", "detach", "alias", "reshape", "split", "unbind", "chunk", "split_with_sizes", "narrow", "lift_fresh",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "is_nonzero", "_local_scalar_dense",
    "item", "size", "stride", "dim", "sym_size", "numel", "promote_types", "result_type", "is_same_size",
    "_reshape_alias", "set_", "resize_", "view_as_real", "view_as_complex", "expand_as", "_is_all_true",
})


@dataclass
class Launches:
    """What one counted call launched: aten ops and Triton kernels by name."""

    aten: collections.Counter = field(default_factory=collections.Counter)
    triton: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())


class _Census(TorchDispatchMode):
    def __init__(self, launches: Launches):
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.launches.aten[name] += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn: Callable[[], Any]) -> tuple[Any, Launches]:
    """``(fn(), its launches)``. Triton launches are counted through the interpreter (``TRITON_INTERPRET=1``);
    a compiled kernel on a GPU is not seen by this count."""
    from triton.runtime import interpreter

    launches = Launches()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.triton[self.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's copies of the arguments are not the kernel's launches
            return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted
    try:
        with _Census(launches):
            result = fn()
    finally:
        interpreter.InterpretedFunction.run = run
    return result, launches


def train_step(model_name: str, dtype: torch.dtype, grouped_mm: bool, tokens: int = 128,
               lora_alpha: float = 16.0) -> tuple[Launches, int]:
    """The launches of one LoRA training step (the second) and the model's decoder layer count."""
    from notebookkit import FastLanguageModel
    from notebookkit.kernels.runtime import use_triton

    if grouped_mm:
        import notebookkit.kernels.moe_experts as experts

        experts.grouped_mm_applies = lambda *args, **kwargs: True
    model, _ = FastLanguageModel.from_pretrained(model_name, load_in_4bit=True, dtype=dtype, max_seq_length=2 * tokens,
                                                 show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=lora_alpha, use_gradient_checkpointing=False,
                                             show_banner=False)
    ids = torch.randint(5, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    with use_triton(True):
        step()
        _, launches = count_launches(step)
    return launches, model.config.num_hidden_layers


def decode_step(model_name: str, dtype: torch.dtype, load_in_4bit: bool = True,
                lora_alpha: float = 16.0) -> tuple[Launches, int]:
    """The launches of one decode step (the second of a ``generate`` call: ``cached_forward`` for one token)."""
    import importlib

    from notebookkit import FastLanguageModel
    from notebookkit.kernels.runtime import use_triton

    generation = importlib.import_module("notebookkit.models.generation.generate")  # the module, not its function
    model, tokenizer = FastLanguageModel.from_pretrained(model_name, load_in_4bit=load_in_4bit, dtype=dtype,
                                                         show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=lora_alpha, show_banner=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"])
    FastLanguageModel.for_inference(model)
    ids = tokenizer("Hello there, how are you", return_tensors="pt").input_ids
    seen: dict[str, Any] = {"calls": 0}
    forward = generation.cached_forward

    def spy(*args, **kwargs):
        seen["calls"] += 1
        if seen["calls"] == 3:  # the prefill, a first decode step, then this one
            out, seen["launches"] = count_launches(lambda: forward(*args, **kwargs))
            return out
        return forward(*args, **kwargs)

    with use_triton(True):
        model.generate(ids, max_new_tokens=3, do_sample=False)  # compiles and builds the decode state
        generation.cached_forward = spy
        try:
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        finally:
            generation.cached_forward = forward
    return seen["launches"], model.config.num_hidden_layers


def vision_step(model_name: str, dtype: torch.dtype, lora_alpha: float = 16.0) -> tuple[Launches, int]:
    """The launches of one training step (the second) of a vision-language model: LoRA r = 8 on both towers,
    checkpointing on (the lean plan's tower runs its blocks again in the backward), two bundled captioned images;
    and the decoder's layer count."""
    from notebookkit import FastVisionModel
    from notebookkit.data import VisionDataCollator
    from notebookkit.embedded.bundled import load_bundled
    from notebookkit.kernels.runtime import use_triton

    model, processor = FastVisionModel.from_pretrained(model_name, dtype=dtype, load_in_4bit=True, show_banner=False)
    model = FastVisionModel.get_peft_model(model, r=8, lora_alpha=lora_alpha, finetune_vision_layers=True,
                                           use_gradient_checkpointing=True, show_banner=False).train()
    rows = load_bundled("captions")
    batch = VisionDataCollator(model.get_base_model(), processor, max_seq_length=256)([rows[0], rows[1]])

    def step():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    with use_triton(True):
        step()
        _, launches = count_launches(step)
    config = model.get_base_model().config
    return launches, getattr(config, "text_config", config).num_hidden_layers


def report(what: str, launches: Launches, layers: int) -> str:
    lines = [f"{what}: {launches.total} launches ({sum(launches.aten.values())} aten, "
             f"{sum(launches.triton.values())} Triton), {launches.total / layers:.1f} a decoder layer ({layers})",
             "aten:   " + ", ".join(f"{k} {v}" for k, v in launches.aten.most_common()),
             "triton: " + ", ".join(f"{k} {v}" for k, v in launches.triton.most_common())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["train", "decode", "vision"])
    ap.add_argument("--model", default="notebookkit/tiny-llama")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--grouped-mm", action="store_true", help="train: the experts on grouped_mm's path")
    ap.add_argument("--lora-alpha", type=float, default=16.0,
                    help="LoRA alpha at r = 8 (16: scaling 2; 8: scaling 1, the benchmarks' alpha = r)")
    ap.add_argument("--16bit", dest="sixteen_bit", action="store_true", help="decode: a 16-bit base, not NF4")
    args = ap.parse_args(argv)
    from notebookkit.kernels.runtime import interpreter_on

    if not interpreter_on():
        raise SystemExit("launch_census.py counts under Triton's interpreter: run it with TRITON_INTERPRET=1.")
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    if args.mode == "train":
        launches, layers = train_step(args.model, dtype, args.grouped_mm, lora_alpha=args.lora_alpha)
        what = (f"one training step of {args.model} ({args.dtype}{', grouped_mm' if args.grouped_mm else ''}, "
                f"lora_alpha {args.lora_alpha:g} at r = 8)")
    elif args.mode == "vision":
        launches, layers = vision_step(args.model, dtype, lora_alpha=args.lora_alpha)
        what = f"one vision-language training step of {args.model} ({args.dtype}, NF4, both towers adapted)"
    else:
        launches, layers = decode_step(args.model, dtype, not args.sixteen_bit, lora_alpha=args.lora_alpha)
        what = f"one decode step of {args.model} ({args.dtype}, {'16-bit' if args.sixteen_bit else 'NF4'})"
    print(report(what, launches, layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
