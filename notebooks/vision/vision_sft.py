# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Vision fine-tuning: teach a vision-language model to caption images
#
# A vision-language model (VLM) reads an image as a few dozen to a few thousand *image tokens*: a
# vision tower turns patches of pixels into features, a projector maps them into the language model's
# embedding space, and the language decoder reads them like words. This notebook fine-tunes LoRA
# adapters on both the vision tower and the decoder so that the model describes an image in one
# sentence, and checks on **held-out images** whether it learned to *see* the colour and the shape.
#
# Steps: **panels** → **load** the model and its processor → **LoRA** on the vision and language
# layers → **data** (images with captions, the collator, the masking check) → **captions before
# training** → **train** with a live dashboard → **captions after training** → **save** the adapter
# and **export** the merged model → the learning check.
#
# *On a CPU it uses `notebookkit/tiny-qwen2.5-vl`: a small Qwen2.5-VL model (the family of the GPU
# default) built offline with random weights, so nothing is downloaded. It starts out unable to
# caption at all; a CPU run of a minute teaches it the caption format and to read the colour off the
# image (shapes need a longer run or a real vision tower). On a GPU it uses Qwen2.5-VL 7B.*

# %% [markdown]
# **Install.** On Colab or Kaggle the next cell installs notebookkit; where it is installed already (a clone
# after `make setup`) it does nothing. notebookkit is not on PyPI yet, so give it a source: upload the wheel
# that `make dist` builds (`dist/notebookkit-*.whl`: Colab's Files panel, or a Kaggle data set), or set
# `NOTEBOOKKIT_SOURCE` to a wheel path or a git URL of the repository (`git+https://...`). When it cannot
# install, the cell stops the notebook and says what to do (README, "On Colab / Kaggle").

# %%
NOTEBOOKKIT_SOURCE = ""  # wheel path, "git+<url>" or pip spec; "": an uploaded notebookkit-*.whl, else PyPI
import glob, importlib.util, os, subprocess, sys

if importlib.util.find_spec("notebookkit") is None:
    wheels = sorted(glob.glob("notebookkit-*.whl") + glob.glob("/content/**/notebookkit-*.whl", recursive=True)
                    + glob.glob("/kaggle/input/**/notebookkit-*.whl", recursive=True))
    source = NOTEBOOKKIT_SOURCE or os.environ.get("NOTEBOOKKIT_SOURCE") or (wheels[-1] if wheels else "notebookkit")
    print(f"installing notebookkit from {source} ...")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", source], capture_output=True, text=True)
    importlib.invalidate_caches()
    if pip.returncode or importlib.util.find_spec("notebookkit") is None:
        raise RuntimeError(
            f"notebookkit could not be installed from {source!r}:\n{pip.stderr.strip()[-1500:]}\n\nWhat to do: "
            "run `make dist` in a clone of the repository and upload dist/notebookkit-*.whl beside this notebook "
            "(Colab: Files panel; Kaggle: Add data), or set NOTEBOOKKIT_SOURCE above to that wheel's path or to "
            "git+<URL of the repository>; then run this cell again.")
from notebookkit import FastLanguageModel  # imports torch, transformers and peft: an install that cannot run fails here
import notebookkit
print(f"notebookkit {notebookkit.__version__} from {os.path.dirname(notebookkit.__file__)}")

# %% [markdown]
# **Parameters.** `None` means "choose for this machine": the tiny model and a few hundred steps on a
# CPU, Qwen2.5-VL 7B in 4-bit on a GPU. CI overrides this cell (it is tagged `parameters`).

# %% tags=["parameters"]
MODEL_NAME = None          # None: "notebookkit/tiny-qwen2.5-vl" on CPU, GPU_MODEL on a GPU
GPU_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
LOAD_IN_4BIT = None        # None: 4-bit on a GPU, 32-bit on CPU
MAX_SEQ_LENGTH = None      # None: 2048 on a GPU, 256 on CPU (image tokens included)
DTYPE = None               # None: bfloat16 where the GPU has it natively, else float16 (a T4)
LORA_R = 16
FINETUNE_VISION_LAYERS = True
FINETUNE_LANGUAGE_LAYERS = True
MAX_STEPS = None           # None: 60 on a GPU, CPU_STEPS on CPU
CPU_STEPS = 450
BATCH_SIZE = None          # None: 2 on a GPU (x 4 accumulated), 8 on CPU: eight 448x448 images of a 7B in one
GRAD_ACCUM = None          # ... batch need more than a T4's 15 GiB; 2 x 4 trains on the same 8 rows per step
LEARNING_RATE = None       # None: 2e-4 on a GPU, CPU_LEARNING_RATE on CPU
CPU_LEARNING_RATE = 5e-3   # the tiny model learns in few steps with a larger rate
WARMUP_STEPS = 10
N_EVAL = 60                # held-out images to caption before and after training (the whole eval split)
SEED = 3407
OUTPUT_DIR = "outputs/vision_sft"
EXPORT_MERGED = True       # also write the merged 16-bit model (notebookkit.export) and reload it
MIN_LOSS_DROP = 0.2        # the last cell asserts the training loss fell by at least this fraction
MIN_ACCURACY_GAIN = 0.25   # ... and the held-out caption accuracy rose by at least this much

# %%
from notebookkit.notebook_cells import apply_script_arguments, resolve_parameters

apply_script_arguments(globals())  # run as a script: --config FILE and --NAME VALUE flags (in Jupyter: nothing)
ON_GPU = resolve_parameters(
    globals(),
    gpu=dict(MODEL_NAME=GPU_MODEL, LOAD_IN_4BIT=True, MAX_SEQ_LENGTH=2048, MAX_STEPS=60, BATCH_SIZE=2, GRAD_ACCUM=4,
             LEARNING_RATE=2e-4),
    cpu=dict(MODEL_NAME="notebookkit/tiny-qwen2.5-vl", LOAD_IN_4BIT=False, MAX_SEQ_LENGTH=256, MAX_STEPS=CPU_STEPS,
             BATCH_SIZE=8, GRAD_ACCUM=1, LEARNING_RATE=CPU_LEARNING_RATE),
)

# %% [markdown]
# ## 1. Choose the model, the adapter and the training run
#
# The panels below hold every setting the rest of the notebook reads (nothing is hidden in globals).
# Beside the model panel, the **VRAM estimate** is recomputed as you change anything: base weights
# (halved again by 4-bit), LoRA adapters with their optimizer state, activations (which gradient
# checkpointing trades for recomputation), and the logits/loss buffer (which grows with
# `max_seq_length` × vocabulary). The verdict compares it with your GPU, or with a card you pick.
#
# Change the panels, then run the cells below again from the next one.

# %%
from notebookkit.widgets import ConfigPanels

panels = ConfigPanels(
    model=dict(model_name=MODEL_NAME, load_in_4bit=LOAD_IN_4BIT, max_seq_length=MAX_SEQ_LENGTH, dtype=DTYPE),
    lora=dict(r=LORA_R, lora_alpha=LORA_R, random_state=SEED),
    training=dict(max_steps=MAX_STEPS, per_device_train_batch_size=BATCH_SIZE,
                  gradient_accumulation_steps=GRAD_ACCUM, learning_rate=LEARNING_RATE,
                  warmup_steps=WARMUP_STEPS, seed=SEED),
)
panels

# %% [markdown]
# ## 2. Load the model and its processor
#
# `FastVisionModel.from_pretrained` returns the model and its **processor**: the chat template, the
# tokenizer and the image processor (resizing and normalising the pixels, cutting them into patches).
# The banner says what runs fused: the language decoder is on the same kernels as
# `FastLanguageModel` (RMSNorm, RoPE, LoRA QKV/O and MLP, the fused cross-entropy, the memory
# planner); in the vision tower its RMSNorms and gated MLPs where it has them, the rest stock.

# %%
cfg = panels.value  # the panels' current values
from notebookkit import FastVisionModel

model, processor = FastVisionModel.from_pretrained(**cfg.model.from_pretrained_kwargs())

# %% [markdown]
# ## 3. Add LoRA adapters to the vision and language layers
#
# The four switches pick the layers: the vision tower (and its projector) and/or the language decoder,
# their attention and/or MLP projections. Adapting the vision tower lets the model learn new visual
# features; adapting the decoder teaches it what to say about them.

# %%
model = FastVisionModel.get_peft_model(
    model,
    finetune_vision_layers=FINETUNE_VISION_LAYERS,
    finetune_language_layers=FINETUNE_LANGUAGE_LAYERS,
    finetune_attention_modules=True,
    finetune_mlp_modules=True,
    r=cfg.lora.r, lora_alpha=cfg.lora.lora_alpha, lora_dropout=cfg.lora.lora_dropout, bias=cfg.lora.bias,
    use_gradient_checkpointing=cfg.lora.use_gradient_checkpointing, random_state=cfg.lora.random_state,
)

# %% [markdown]
# ## 4. Data: images with captions
#
# The bundled set has 64x64 images of one coloured shape each, with a caption, in the layout TRL and
# the most used vision notebooks use: `messages` (the user turn holds an `{"type": "image"}` item and
# the question, the assistant turn the caption) and the image (`images` in TRL's layout; a single
# `image` column works too).

# %%
import matplotlib.pyplot as plt
from notebookkit.data import load_bundled

train_ds = load_bundled("captions")
heldout_ds = load_bundled("captions", split="eval")
heldout_ds = heldout_ds.select(range(min(N_EVAL, len(heldout_ds))))
print(train_ds)
print(train_ds[0]["messages"])
fig, axes = plt.subplots(1, 6, figsize=(12, 2.6))
for ax, row in zip(axes, train_ds.select(range(6))):
    ax.imshow(row["image"]); ax.set_axis_off()
    ax.set_title(row["caption"].replace(" on a ", "\non a ", 1), fontsize=7)
fig.suptitle(f"{len(train_ds)} training images, {len(heldout_ds)} held out (colour/shape pairs never shown in training)")
fig.tight_layout()

# %% [markdown]
# **The collator and the masking check.** `VisionDataCollator` renders each conversation with the chat
# template, lets the processor expand the image item into the model's image tokens and prepare the
# pixels, and keeps labels only on the caption (and the end-of-turn token, so the model learns to
# stop): the question, the image tokens and the padding are `-100`. Green is trained, grey masked.

# %%
from notebookkit.data import VisionDataCollator
from notebookkit.data.masking import masking_report_from_batch

collator = VisionDataCollator(model, processor)
print(f"checked {collator.check(train_ds)} training rows: every image decodes, one image per image item")
batch = collator([train_ds[i] for i in range(2)])
print({k: tuple(v.shape) for k, v in batch.items()})
masking_report_from_batch(batch, processor.tokenizer, max_examples=2)

# %% [markdown]
# ## 5. Captions before training
#
# The model captions the held-out images (greedy decoding). A caption scores when its colour and shape
# words are exactly the true ones.

# %%
from notebookkit.embedded.caption_scores import score_captions
from notebookkit.models.vision_generate import generate_vision_replies

heldout_rows = [heldout_ds[i] for i in range(len(heldout_ds))]
train_reference = [{"colour": c, "shape": s} for c, s in zip(train_ds["colour"], train_ds["shape"])]
captions_before = generate_vision_replies(model, processor, heldout_rows, max_new_tokens=20)
score_before = score_captions(captions_before, heldout_rows, train_reference)
print("before training:", score_before)
for reference, generated, verdict in score_before.rows[:4]:
    print(f"  reference: {reference}\n  generated: {generated!r} ({verdict})")

# %% [markdown]
# ## 6. Train, with the live dashboard
#
# TRL's `SFTTrainer` (notebookkit's `FastSFTTrainer`: the loss runs the fused cross-entropy) with the
# collator; the dataset rows reach it untouched.

# %%
from notebookkit.train import sft_config
from notebookkit.train.sft import FastSFTTrainer

args = sft_config(
    OUTPUT_DIR, model=model, max_length=None, **cfg.training.trainer_kwargs(),
    remove_unused_columns=False,                      # the collator needs the messages and images columns
    dataset_kwargs={"skip_prepare_dataset": True},    # ... as they are: it renders and tokenises them itself
)
trainer = FastSFTTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator,
                         processing_class=processor)

# %%
from notebookkit.widgets import LiveDashboard

dashboard = LiveDashboard().attach(trainer)  # in place of the trainer's "Step | Training Loss" table
train_result = trainer.train()
dashboard.save_figure(f"{OUTPUT_DIR}/dashboard.png")
print(f"trained {train_result.global_step} steps in {train_result.metrics['train_runtime']:.0f} s")
if trainer.args.fp16:  # fp16 trains under a loss scaler, which skips a step whose gradients overflow
    print(f"fp16: {dashboard.skipped_steps} of {train_result.global_step} optimizer steps skipped for inf/NaN gradients")

# %% [markdown]
# ## 7. Captions after training, on the held-out images

# %%
import matplotlib.pyplot as plt

captions_after = generate_vision_replies(model, processor, heldout_rows, max_new_tokens=20)
score_after = score_captions(captions_after, heldout_rows, train_reference)
print("before training:", score_before)
print("after training: ", score_after)
fig, axes = plt.subplots(1, 6, figsize=(13, 3.2))
for ax, row, before, after in zip(axes, heldout_rows, captions_before, captions_after):
    ax.imshow(row["image"]); ax.set_axis_off()
    ax.set_title(f"before: {before[:28]!r}\nafter: {after[:40]}\ntrue: {row['colour']} {row['shape']}", fontsize=6)
fig.tight_layout(); fig.savefig(f"{OUTPUT_DIR}/captions.png", dpi=100)

# %%
from notebookkit.notebook_cells import plot_loss_curve

fig = plot_loss_curve(trainer, f"{OUTPUT_DIR}/loss_curve.png")

# %% [markdown]
# ## 8. Save the adapter, export the merged model
#
# The adapter holds only the LoRA matrices; `FastVisionModel.from_pretrained("<adapter folder>")`
# loads base + adapter again. `save_pretrained_merged` (notebookkit.export) writes the model with the
# adapter merged into 16-bit weights, which plain `transformers` loads; it is reloaded here and
# compared with the adapter model. (GGUF export is for text models only.) A model loaded in 4-bit is
# reloaded in 4-bit too: a 16-bit 7B (15 GB) does not fit a T4 beside the adapter model, so there the
# difference also holds the re-quantisation of the merged weights.

# %%
import pathlib
import torch

adapter_dir = f"{OUTPUT_DIR}/lora_adapter"
model.save_pretrained(adapter_dir)
processor.save_pretrained(adapter_dir)
print("adapter:", sorted(p.name for p in pathlib.Path(adapter_dir).iterdir()))
if EXPORT_MERGED:
    merged_dir = f"{OUTPUT_DIR}/merged_16bit"
    print(model.save_pretrained_merged(merged_dir, processor.tokenizer, save_method="merged_16bit"))
    processor.save_pretrained(merged_dir)
    merged, _ = FastVisionModel.from_pretrained(merged_dir, max_seq_length=cfg.model.max_seq_length,
                                                load_in_4bit=cfg.model.load_in_4bit, dtype=cfg.model.dtype, show_banner=False)
    sample = {k: v.to(merged.device) for k, v in collator(heldout_rows[:2]).items() if k != "labels"}
    FastVisionModel.for_inference(model); FastVisionModel.for_inference(merged)
    with torch.no_grad():
        gap = (model(**sample).logits.float() - merged(**sample).logits.float()).abs().max().item()
    print(f"merged model reloaded: largest logit difference against the adapter model {gap:.2e}")
    del merged

# %% [markdown]
# ## Last: did it learn to see? (checked automatically)
#
# CI runs this notebook on the tiny default and this cell fails the run unless the model learned:
# the training loss must fall by at least `MIN_LOSS_DROP` (first three logged steps against the last
# three), and the held-out caption accuracy (exact match of the colour and shape words) must rise by
# at least `MIN_ACCURACY_GAIN` and end above the level of always naming the most frequent colour and
# shape. The held-out images pair colours and shapes that no training image shows together, so the
# model cannot score by remembering pairs. With `LEARNING_RATE = 0` the check fails: the model never
# learns the caption format, and scores 0.

# %%
from notebookkit.notebook_cells import first_and_last

first, last = first_and_last(trainer, "loss", n=3)  # mean training loss of the first and of the last 3 steps
drop = 1 - last / first
gain = score_after.accuracy - score_before.accuracy
print(f"training loss {first:.3f} -> {last:.3f} ({drop:.0%} lower; required: {MIN_LOSS_DROP:.0%})")
print(f"held-out caption accuracy {score_before.accuracy:.0%} -> {score_after.accuracy:.0%} "
      f"(+{gain:.0%}; required: +{MIN_ACCURACY_GAIN:.0%} and above {score_after.chance:.0%}, the most frequent words)")
assert drop >= MIN_LOSS_DROP, f"training loss fell only {drop:.1%} (< {MIN_LOSS_DROP:.0%})"
assert gain >= MIN_ACCURACY_GAIN, f"held-out caption accuracy rose only {gain:.1%} (< {MIN_ACCURACY_GAIN:.0%})"
assert score_after.accuracy > score_after.chance, (
    f"held-out caption accuracy {score_after.accuracy:.1%} is not above guessing ({score_after.chance:.1%})")
print("learning signal: OK")
