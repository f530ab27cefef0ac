"""fp16 training under a loss scaler, as on a T4: does the first step at the scaler's initial scale overflow?

One system per process (``--system notebookkit|hf|unsloth``), the model loaded in float16, a VRAM cap
(``torch.cuda.set_per_process_memory_fraction``), ``torch.autocast(float16)`` and ``torch.amp.GradScaler``
at its default initial scale (65536), AdamW. Prints one ``RESULT {json}`` line: the scale before and after
each step (a step whose gradients held inf/NaN is skipped and the scale halves), the losses, tokens/s and
the peak memory.

``--trace`` also records, during the first backward pass, the largest gradient magnitude reaching the
output of every decoder layer and of its attention, MLP and norms, and the LoRA parameters whose gradients
are not finite: where the fp16 headroom runs out. Run it on the GPU machine, e.g.

    python benchmarks/fp16_first_step.py --system notebookkit --seq 2048 --batch 1 --cap-gib 15 --trace
"""

from __future__ import annotations

import argparse
import json
import sys
import time

if "--system" in sys.argv and sys.argv[sys.argv.index("--system") + 1] == "unsloth":
    import unsloth  # noqa: F401  (Unsloth must be imported before transformers)

import torch

from train_step import INITIAL_SCALE, SHAPES, TARGETS, build_checkpoint, cap_gpu_memory, skipped_flags  # this folder is on sys.path


def load(system: str, folder: str, seq: int, batch: int, checkpointing: str):
    if system == "notebookkit":
        from notebookkit import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=seq, dtype=torch.float16, load_in_4bit=True)
        gc_mode: object = {"true": True, "false": False}.get(checkpointing, checkpointing)
        return FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=16, target_modules=TARGETS, use_gradient_checkpointing=gc_mode,
            random_state=3407, planning_batch_size=batch,
        )
    if system == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=seq, dtype=torch.float16,
                                                     load_in_4bit=True)
        return FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=16, lora_dropout=0, bias="none", target_modules=TARGETS,
            use_gradient_checkpointing="unsloth", random_state=3407,
        )
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float16)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16, device_map={"": 0},
                                                 attn_implementation="sdpa", quantization_config=quant)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(3407)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                            target_modules=TARGETS, task_type="CAUSAL_LM"))


class GradTrace:
    """Largest |gradient| reaching each traced module's output during one backward pass."""

    KINDS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "norm", "embed_tokens")

    def __init__(self, model):
        self.rows: list[tuple[str, float]] = []
        self.handles = []
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            is_layer = leaf.isdigit() and name.endswith(f"layers.{leaf}")
            if is_layer or leaf in self.KINDS:
                self.handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda g: self.rows.append((name, g.detach().abs().float().amax().item())))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", required=True, choices=["notebookkit", "hf", "unsloth"])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cap-gib", type=float, default=15.0)
    ap.add_argument("--checkpointing", default="auto")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()

    folder = build_checkpoint(args.shape)
    cap_gpu_memory(args.cap_gib)
    torch.cuda.reset_peak_memory_stats()
    model = load(args.system, folder, args.seq, args.batch, args.checkpointing)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4)
    scaler = torch.amp.GradScaler("cuda", init_scale=INITIAL_SCALE)
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(3, vocab, (args.batch, args.seq), device="cuda", generator=gen) for _ in range(args.steps)]

    scales, losses, trace, nonfinite, grad_amax = [], [], None, [], {}
    torch.cuda.synchronize()
    start = time.time()
    for i, ids in enumerate(batches):
        tracer = GradTrace(model) if (args.trace and i == 0) else None
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if tracer is not None:
            tracer.remove()
            trace = tracer.rows
            for n, p in named:
                if p.grad is not None:
                    a = p.grad.detach().abs().float().amax().item()
                    grad_amax[n] = a
                    if not torch.isfinite(p.grad).all():
                        nonfinite.append(n)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 5))
        scales.append(scaler.get_scale())
    torch.cuda.synchronize()
    elapsed = time.time() - start
    result = dict(
        system=args.system, shape=args.shape, seq=args.seq, batch=args.batch, cap_gib=args.cap_gib,
        scales=scales, skipped=skipped_flags(scales), losses=losses,
        tok_s=round(args.batch * args.seq * args.steps / elapsed, 1),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
    )
    if args.trace:
        top = sorted(grad_amax.items(), key=lambda kv: -kv[1])[:12]
        result.update(trace=trace, nonfinite_lora=nonfinite[:40], n_nonfinite_lora=len(nonfinite), top_lora_grads=top)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
