"""Why does the vision notebook's tiny default learn less in fp16 than in bf16? One training run per variant, the
vision notebook's own steps (tiny Qwen2.5-VL, the bundled captions, FastSFTTrainer, held-out caption accuracy),
with the loss scaler, skipped steps, gradient norms and losses recorded.

    PYTHONPATH=$PWD/.site:$PWD python3 benchmarks/vision_fp16_probe.py --variants fp16-4bit,bf16-4bit,fp16-16bit

Prints one JSON line per variant and a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def run(variant: str, steps: int, lr: float, batch: int, accum: int = 1, seed: int = 3407) -> dict:
    import torch
    from transformers import TrainerCallback

    from notebookkit import FastVisionModel
    from notebookkit.data import VisionDataCollator, load_bundled
    from notebookkit.embedded.caption_scores import score_captions
    from notebookkit.models.vision_generate import generate_vision_replies
    from notebookkit.train import sft_config
    from notebookkit.train.sft import FastSFTTrainer

    dtype, bits = variant.split("-")
    torch.manual_seed(seed)
    model, processor = FastVisionModel.from_pretrained("notebookkit/tiny-qwen2.5-vl", max_seq_length=256,
                                                       dtype={"fp16": "float16", "bf16": "bfloat16"}[dtype],
                                                       load_in_4bit=bits == "4bit", show_banner=False)
    model = FastVisionModel.get_peft_model(model, finetune_vision_layers=True, finetune_language_layers=True,
                                           finetune_attention_modules=True, finetune_mlp_modules=True, r=16,
                                           lora_alpha=16, random_state=seed, show_banner=False)
    train_ds, heldout = load_bundled("captions"), load_bundled("captions", split="eval")
    rows = [heldout[i] for i in range(len(heldout))]
    reference = [{"colour": c, "shape": s} for c, s in zip(train_ds["colour"], train_ds["shape"])]
    before = score_captions(generate_vision_replies(model, processor, rows, max_new_tokens=20), rows, reference)
    record: dict = {"scale": [], "skipped": 0, "grad_norm": [], "loss": []}

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            scaler = getattr(trainer.accelerator, "scaler", None)
            if scaler is not None:
                record["scale"].append(float(scaler.get_scale()))
            if getattr(kw.get("optimizer"), "step_was_skipped", False):
                record["skipped"] += 1

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "loss" in logs:
                record["loss"].append(float(logs["loss"]))
                record["grad_norm"].append(float(logs.get("grad_norm", float("nan"))))

    args = sft_config("/tmp/vision-probe", model=model, max_length=None, max_steps=steps, learning_rate=lr,
                      per_device_train_batch_size=batch, gradient_accumulation_steps=accum, warmup_steps=10, logging_steps=10, seed=seed,
                      remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True}, report_to=[])
    trainer = FastSFTTrainer(model=model, args=args, train_dataset=train_ds,
                             data_collator=VisionDataCollator(model, processor), processing_class=processor,
                             callbacks=[Probe()])
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = score_captions(generate_vision_replies(model, processor, rows, max_new_tokens=20), rows, reference)
    trainable = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    losses = record["loss"]
    return dict(variant=variant, accum=accum, seed=seed, fp16=args.fp16, bf16=args.bf16, optim=args.optim, trainable=trainable,
                accuracy_before=before.accuracy, accuracy_after=after.accuracy, gain=after.accuracy - before.accuracy,
                loss_first=statistics.mean(losses[:3]), loss_last=statistics.mean(losses[-3:]), skipped=record["skipped"],
                final_scale=record["scale"][-1] if record["scale"] else None, grad_norms=record["grad_norm"][:6],
                seconds=round(seconds, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="fp16-4bit,bf16-4bit,fp16-16bit,bf16-16bit")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation (the notebook: 1)")
    args = parser.parse_args()
    rows = []
    for variant in args.variants.split(","):
        row = run(variant, args.steps, args.lr, args.batch, args.accum, args.seed)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| variant | optim | accuracy before -> after | loss first -> last | skipped | final scale | s |")
    for r in rows:
        print(f"| {r['variant']} | {r['optim']} | {r['accuracy_before']:.0%} -> {r['accuracy_after']:.0%} | "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['skipped']} | {r['final_scale']} | {r['seconds']} |")


if __name__ == "__main__":
    main()
