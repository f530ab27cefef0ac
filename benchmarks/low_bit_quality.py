"""Held-out loss of a pre-trained model with its projections at 16-bit, NF4, 2-bit and ternary, and after a
short LoRA recovery fine-tune on the 2-bit and ternary bases. CPU, fp32 arithmetic; prints a markdown table.

What it is measured on (nothing can be downloaded here): the embedded default's pre-trained
``notebookkit/tiny-llama`` (Llama architecture, 4 layers, hidden 128, MLP 384, vocabulary 2,048, 1.05 M
parameters, 440 pre-training steps) and its bundled corpus. The corpus is generated English prose about
a small world: 8,000 training documents, and 300 held-out documents drawn with another seed. Windows of
128 tokens, ``<|begin_of_text|> doc <|end_of_text|>`` concatenated, as the pre-training cut them.

Rows:

* **weights only** (``AutoModelForCausalLM`` in fp32, each decoder projection replaced by what its
  quantised form decodes to; the quantisers are the ones the loaders use):
  16-bit (bf16-rounded), NF4 (bitsandbytes' ``quantize_4bit``, blocks of 64, nested absmax, decoded by
  :func:`notebookkit.kernels.nf4.dequantize_nf4_reference`), 2-bit groups of 64
  (:func:`notebookkit.kernels.q2.quantize_q2`: ``lsq``, the default, and the ``minmax`` / ``hqq`` fits),
  ternary (:func:`notebookkit.kernels.ternary.quantize_ternary`, a scale per row);
* **through notebookkit** (``FastLanguageModel.from_pretrained(..., load_in_2bit=True)``, and the
  embedded ``notebookkit/tiny-llama-ternary``, on the fused path), before and after LoRA (r = 16, all
  seven projections, AdamW, lr 1e-3, batch 16 x 128 tokens, ``--steps`` steps on the training documents);
  the same LoRA run on the 16-bit model (``load_in_4bit=False``: ``from_pretrained`` loads NF4 by default)
  is the control, and on the NF4 model the usual QLoRA. What the recovery gains beyond the control is
  quantisation error recovered; the rest is more training on the same text.

Run: ``PYTHONPATH=. python benchmarks/low_bit_quality.py [--steps 300]`` (about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # registry_assets, run as a script
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL = "notebookkit/tiny-llama"
TERNARY_MODEL = "notebookkit/tiny-llama-ternary"


def corpus_windows(folder: str, seq_len: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) windows of the bundled corpus, cut as the pre-training cut them."""
    from tokenizers import Tokenizer

    from notebookkit.embedded.generate_pretrain import token_stream, windows
    from notebookkit.embedded.tiny import load_corpus

    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    bos, eot = "<|begin_of_text|>", "<|end_of_text|>"
    return (windows(token_stream(tok, load_corpus("train"), bos, eot), seq_len),
            windows(token_stream(tok, load_corpus("heldout"), bos, eot), seq_len))


def austen_windows(folder: str, seq_len: int, heldout_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) windows of real English prose: *Pride and Prejudice* to train on, the first
    ``heldout_windows`` windows of *Persuasion* held out (:mod:`registry_assets`)."""
    from registry_assets import austen_novels
    from transformers import AutoTokenizer

    from notebookkit.embedded.generate_pretrain import windows

    tok = AutoTokenizer.from_pretrained(folder)
    novels = austen_novels()
    train, held = (tok(novels[title], add_special_tokens=False)["input_ids"]
                   for title in ("pride and prejudice", "persuasion"))
    return windows(train, seq_len), windows(held, seq_len)[:heldout_windows]


def heldout_loss(model, held: torch.Tensor, batch_size: int = 8) -> float:
    from notebookkit.embedded.generate_pretrain import mean_loss

    return round(mean_loss(model, held, batch_size), 4)


def decoded(weight: torch.Tensor, form: str) -> torch.Tensor:
    """``weight`` as its quantised ``form`` decodes it, fp32."""
    w = weight.detach().float()
    if form == "bf16":
        return w.bfloat16().float()
    if form == "nf4":
        import bitsandbytes.functional as bnbf

        from notebookkit.kernels.nf4 import dequantize_nf4_reference

        packed, state = bnbf.quantize_4bit(w.to(torch.bfloat16), blocksize=64, quant_type="nf4",
                                           compress_statistics=True)
        return dequantize_nf4_reference(packed, state, out_dtype=torch.float32)
    if form.startswith("2bit"):
        from notebookkit.kernels.q2 import dequantize_q2_reference, quantize_q2

        method = form.split("-", 1)[1]
        return dequantize_q2_reference(quantize_q2(w, 64, method=method), torch.float32)
    if form == "ternary":
        from notebookkit.kernels.ternary import dequantize_ternary_reference, quantize_ternary

        return dequantize_ternary_reference(quantize_ternary(w), torch.float32)
    raise ValueError(form)


def weights_only(base, form: str):
    """A copy of ``base`` whose decoder projections hold what ``form`` decodes them to."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS:
                module.weight.copy_(decoded(module.weight, form))
    return model


def recover(model, train: torch.Tensor, held: torch.Tensor, steps: int, batch: int, lr: float,
            seed: int = 0) -> tuple[float, float]:
    """LoRA on ``model`` (notebookkit's fused path) for ``steps`` steps: held-out loss before and after."""
    from notebookkit import FastLanguageModel

    before = heldout_loss(model, held)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                             use_gradient_checkpointing=False, random_state=3407, show_banner=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = train[torch.randint(0, len(train), (batch,), generator=gen)]
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return before, heldout_loss(model, held)


#: the two models: (folder, its training and held-out windows, LoRA batch, learning rate, ternary source)
def setup(which: str, seq_len: int, heldout_windows: int):
    if which == "tiny":
        from notebookkit.embedded.tiny import resolve_model_name

        folder = resolve_model_name(MODEL)
        return folder, *corpus_windows(folder), 16, 1e-3, TERNARY_MODEL
    from registry_assets import smollm2_folder

    folder = str(smollm2_folder())
    return folder, *austen_windows(folder, seq_len, heldout_windows), 4, 1e-3, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--steps", type=int, default=300, help="LoRA recovery steps")
    ap.add_argument("--seq", type=int, default=256, help="smollm2: tokens a window")
    ap.add_argument("--heldout-windows", type=int, default=16, help="smollm2: held-out windows of Persuasion")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from notebookkit import FastLanguageModel

    folder, train, held, batch, lr, ternary_folder = setup(args.model, args.seq, args.heldout_windows)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows: list[dict] = [dict(base="16-bit (fp32)", bits=32, how="weights only", heldout=heldout_loss(base, held))]
    shapes = [m.weight.shape for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in TARGETS]
    ternary_bits = sum(2 * o * k + 16 * o for o, k in shapes) / sum(o * k for o, k in shapes)  # fp16 scale a row
    bits = {"bf16": 16, "nf4": 4 + 8 / 64 + 32 / (64 * 256), "2bit-lsq": 2.5, "2bit-hqq": 2.5, "2bit-minmax": 2.5,
            "ternary": ternary_bits}
    for form, b in bits.items():
        rows.append(dict(base=form, bits=round(b, 3), how="weights only",
                         heldout=heldout_loss(weights_only(base, form), held)))
        print(rows[-1], flush=True)
    del base

    def fast(name: str, **flags):
        model, _ = FastLanguageModel.from_pretrained(name, dtype=torch.float32, max_seq_length=max(args.seq, 128),
                                                     **flags)
        return model

    loads = [("16-bit (fp32)", lambda: fast(folder, load_in_4bit=False)), ("nf4", lambda: fast(folder, load_in_4bit=True)),
             ("2bit-lsq", lambda: fast(folder, load_in_2bit=True))]
    loads.append(("ternary (embedded tiny-llama-ternary)", lambda: fast(ternary_folder)) if ternary_folder else
                 ("ternary (quantised on load)", lambda: fast(folder, load_in_ternary=True)))
    for label, load in loads:
        before, after = recover(load(), train, held, args.steps, batch, lr)
        rows.append(dict(base=label, how="notebookkit load, before LoRA", heldout=before))
        rows.append(dict(base=label, how=f"after LoRA r=16, {args.steps} steps of {batch} x {train.shape[1]}",
                         heldout=after))
        print(rows[-2:], flush=True)

    ref = rows[0]["heldout"]
    print(f"\nHeld-out loss over {len(held)} windows of {held.shape[1]} tokens (perplexity = exp(loss)); "
          f"16-bit reference {ref:.4f}.\n")
    print("| base | bits/weight | how | held-out loss | perplexity | vs 16-bit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['base']} | {r.get('bits', '')} | {r['how']} | {r['heldout']:.4f} | {math.exp(r['heldout']):.3f} "
              f"| {r['heldout'] - ref:+.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
