"""Write the notebooks (notebooks/sft/*.ipynb, notebooks/export/export.ipynb, notebooks/dpo/dpo.ipynb,
notebooks/grpo/grpo.ipynb, notebooks/vision/vision_sft.ipynb) from the cell lists below.

The notebooks are generated so that a review reads this file, and so that every notebook shares the
same install / parameters / evaluation cells. Outputs are never stored: run

    .venv/bin/python scripts/make_notebooks.py          # rewrite the notebooks
    .venv/bin/python scripts/make_notebooks.py --check  # exit 1 if a notebook differs from this file
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# shared cells

INSTALL = '''\
# Install notebookkit where it is missing (Colab, Kaggle). Where it is already installed
# (for example after `make setup` in a clone of the repository) this cell does nothing.
import importlib.util

NOTEBOOKKIT_PIP_SPEC = "notebookkit"  # or a git URL / wheel path of the version you want
if importlib.util.find_spec("notebookkit") is None:
    get_ipython().run_line_magic("pip", f"install -q {NOTEBOOKKIT_PIP_SPEC}")
'''

# the parameters cell (tagged `parameters`); the fields are what differs between notebooks
PARAMETERS = '''\
MODEL_NAME = None          # None: "notebookkit/tiny-llama" on CPU, GPU_MODEL on a GPU
GPU_MODEL = "Qwen/Qwen3-0.6B"
CHAT_TEMPLATE = {chat_template:<10} # {chat_template_note}
LOAD_IN_4BIT = None        # None: 4-bit on a GPU, 16/32-bit on CPU
MAX_SEQ_LENGTH = None      # None: 2048 on a GPU, 512 on CPU (capped by the length profile below)
DTYPE = None               # None: bfloat16 where the GPU has it natively, else float16 (a T4); "float16" forces it
LORA_R = 16
MAX_STEPS = None           # None: 60 on a GPU, CPU_STEPS on CPU
CPU_STEPS = 24
CALIBRATION_STEPS = None   # None: 30 on a GPU, 4 on CPU; 0 skips the calibration
BATCH_SIZE = 4
GRAD_ACCUM = 1
LEARNING_RATE = None       # None: 2e-4 on a GPU, CPU_LEARNING_RATE on CPU
CPU_LEARNING_RATE = 2e-3{cpu_learning_rate_note}
WARMUP_STEPS = 2
N_EVAL = 12                # held-back {heldout_rows} to evaluate on
N_EXACT = 4                # of those, how many are answered by generation (exact match)
SEED = 3407
OUTPUT_DIR = "outputs/{slug}"
MIN_LOSS_DROP = 0.2        # the last cell asserts the training loss fell by at least this fraction
MIN_HELDOUT_DROP = 0.1     # ... and the held-back answer loss by at least this fraction
'''

RESOLVE = '''\
import torch

ON_GPU = torch.cuda.is_available()
MODEL_NAME = MODEL_NAME or (GPU_MODEL if ON_GPU else "notebookkit/tiny-llama")
LOAD_IN_4BIT = ON_GPU if LOAD_IN_4BIT is None else LOAD_IN_4BIT
MAX_SEQ_LENGTH = MAX_SEQ_LENGTH or (2048 if ON_GPU else 512)
MAX_STEPS = MAX_STEPS or (60 if ON_GPU else CPU_STEPS)
CALIBRATION_STEPS = (30 if ON_GPU else 4) if CALIBRATION_STEPS is None else CALIBRATION_STEPS
LEARNING_RATE = LEARNING_RATE or (2e-4 if ON_GPU else CPU_LEARNING_RATE)
torch.manual_seed(SEED)
print(f"device: {torch.cuda.get_device_name(0) if ON_GPU else 'CPU'} | model: {MODEL_NAME} | "
      f"4-bit: {LOAD_IN_4BIT} | steps: {MAX_STEPS} | calibration steps: {CALIBRATION_STEPS}")
'''

PANELS_MD = '''\
## 1. Choose the model, the adapter and the training run

The panels below hold every setting the rest of the notebook reads (nothing is hidden in globals).
Beside the model panel, the **VRAM estimate** is recomputed as you change anything: base weights
(halved again by 4-bit), LoRA adapters with their optimizer state, activations (which gradient
checkpointing trades for recomputation), and the logits/loss buffer (which grows with
`max_seq_length` × vocabulary). The verdict compares it with your GPU, or with a card you pick.

Change the panels, then run the cells below again from the next one.'''

PANELS = '''\
from notebookkit.widgets import ConfigPanels

panels = ConfigPanels(
    model=dict(model_name=MODEL_NAME, load_in_4bit=LOAD_IN_4BIT, max_seq_length=MAX_SEQ_LENGTH, dtype=DTYPE),
    lora=dict(r=LORA_R, lora_alpha=LORA_R, random_state=SEED),
    training=dict(max_steps=MAX_STEPS, per_device_train_batch_size=BATCH_SIZE,
                  gradient_accumulation_steps=GRAD_ACCUM, learning_rate=LEARNING_RATE,
                  warmup_steps=WARMUP_STEPS, seed=SEED),
)
panels
'''

LOAD = '''\
cfg = panels.value  # the panels' current values
from notebookkit import FastLanguageModel
from notebookkit.data import get_chat_template, guess_chat_template

model, tokenizer = FastLanguageModel.from_pretrained(**cfg.model.from_pretrained_kwargs())
CHAT_TEMPLATE = CHAT_TEMPLATE or {chat_template_default}
tokenizer = get_chat_template(tokenizer, CHAT_TEMPLATE, model=model)
print(f"chat template: {{CHAT_TEMPLATE}}; generation stops at {{tokenizer.eos_token!r}}")
'''

LORA_MD = '''\
## 3. Add LoRA adapters

LoRA freezes the pretrained weight `W` and learns a low-rank update: a projection computes
`y = x Wᵀ + (α / r) · x Aᵀ Bᵀ` with `A` of shape `r × in` and `B` of shape `out × r`. `B` starts at
zero, so training starts from exactly the pretrained model, and only `A` and `B` (well under 1 % of
the parameters here) get gradients and optimizer state. With dropout 0 and bias `"none"` the
adapters run inside notebookkit's fused kernels; the banner says which layers do.'''

LORA = '''\
model = FastLanguageModel.get_peft_model(model, **cfg.lora.peft_kwargs())
'''

CALIBRATION_MD = '''\
## 5. Calibration: notebookkit against plain PEFT on this machine

Before the real run, train a few steps twice, from the same checkpoint, seed, adapters and batches:
once with notebookkit's fused kernels and once with plain Hugging Face + PEFT. Both minimise the same
loss from the same starting point, so **the two loss curves should lie on top of each other**; what
may differ is the **peak memory** and the **tokens per second**. On a GPU this tells you what the
fused path buys on *your* card; on a CPU both run PyTorch code and the comparison only checks
that the two paths agree. Set `CALIBRATION_STEPS = 0` to skip it.'''

CALIBRATION = '''\
from notebookkit.train import calibrate

if CALIBRATION_STEPS:
    calibration = calibrate(
        cfg.model.model_name, train_ds, steps=CALIBRATION_STEPS, seed=SEED, max_seq_length=MAX_LENGTH,
        load_in_4bit=cfg.model.load_in_4bit, dtype=cfg.model.dtype, r=cfg.lora.r, lora_alpha=cfg.lora.lora_alpha,
        target_modules=cfg.lora.target_modules, chat_template=CHAT_TEMPLATE,
        use_gradient_checkpointing=cfg.lora.use_gradient_checkpointing,
        per_device_train_batch_size=cfg.training.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.training.gradient_accumulation_steps,
        learning_rate=cfg.training.learning_rate, warmup_steps=0,
    )
    print(calibration.table())
    calibration.plot().savefig(f"{OUTPUT_DIR}/calibration.png", dpi=100)
    print(calibration.summary())
else:
    print("calibration skipped (CALIBRATION_STEPS = 0)")
'''

TRAIN_MD = '''\
## 6. Train, with the live dashboard

`trainer.train()` runs the optimizer steps. The dashboard updates in place while it runs: training
loss (and held-back loss at each evaluation), learning rate, gradient norm, memory now and at peak
(GPU, or this process's RAM on a CPU), tokens per second and the time left. When training ends it
leaves a static figure, so the saved notebook still shows it.'''

TRAIN = '''\
from notebookkit.widgets import LiveDashboard

from transformers import ProgressCallback

dashboard = LiveDashboard()
trainer.remove_callback(ProgressCallback)  # the dashboard replaces the text progress bar
trainer.add_callback(dashboard)
train_result = trainer.train()
dashboard.save_figure(f"{OUTPUT_DIR}/dashboard.png")
print(f"trained {train_result.global_step} steps in {train_result.metrics['train_runtime']:.0f} s")
if trainer.args.fp16:  # fp16 trains under a loss scaler, which skips a step whose gradients overflow
    print(f"fp16: {dashboard.skipped_steps} of {train_result.global_step} optimizer steps skipped for inf/NaN gradients")
'''

LOSS_CURVE = '''\
import matplotlib.pyplot as plt

train_log = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
eval_log = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.plot(*zip(*train_log), label="training loss")
if eval_log:
    ax.plot(*zip(*eval_log), "o-", label="held-back loss")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.set_title("Loss curve"); ax.legend()
fig.tight_layout(); fig.savefig(f"{OUTPUT_DIR}/loss_curve.png", dpi=100)
'''

SAVE_MD = '''\
## 9. Save the adapter

Only the LoRA matrices are saved (a few MB for a real model); the base model is referenced by name.
`FastLanguageModel.from_pretrained("<this folder>")` loads base + adapter again.'''

SAVE = '''\
adapter_dir = f"{OUTPUT_DIR}/lora_adapter"
model.save_pretrained(adapter_dir)
tokenizer.save_pretrained(adapter_dir)
print("saved:", sorted(p.name for p in __import__("pathlib").Path(adapter_dir).iterdir()))
'''

SIGNAL_MD = '''\
## Last: did it learn? (checked automatically)

CI runs this notebook on the tiny default and this cell fails the run unless the model learned:
the training loss must fall by at least `MIN_LOSS_DROP` (first three logged steps against the last
three), and on the held-back questions the answer loss must be at least `MIN_HELDOUT_DROP` lower than
before training (a margin: with the learning rate at 0 it still moved by 0.02%, from 4.451 to 4.450).

Exact match is printed but not asserted: on the tiny default the held-back questions ask about facts
the training rows never mention, and a CPU run of a few dozen steps answers none of them exactly,
before or after training (0 of 8 even after 120 steps, five times the default), so "no worse"
would hold whatever training did. On a real model, after a real run, it is worth reading.'''

SIGNAL = '''\
import statistics

losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
drop = 1 - last / first
print(f"training loss {first:.3f} -> {last:.3f} ({drop:.0%} lower; required: {MIN_LOSS_DROP:.0%})")
print(f"held-back answer loss {loss_before:.3f} -> {loss_after:.3f}; "
      f"exact match {em_before.score:.0%} -> {em_after.score:.0%} (shown, not asserted)")
assert drop >= MIN_LOSS_DROP, f"training loss fell only {drop:.1%} (< {MIN_LOSS_DROP:.0%})"
heldout_drop = 1 - loss_after / loss_before
assert heldout_drop >= MIN_HELDOUT_DROP, (
    f"held-back answer loss fell only {heldout_drop:.1%} (< {MIN_HELDOUT_DROP:.0%}): "
    "the tuned model is not better on the held-back answers")
print("learning signal: OK")
'''


SCALE_OUT_MD = '''\
## 10. Scale out: the same run on several GPUs

A notebook drives one process, so it trains on one GPU. When that is too slow, run the same
training as a script on several GPUs: `scripts/train_sft.py` does what this notebook does (load,
chat template, LoRA, response-only labels, train, save the adapter) and reads the settings you
chose above from a file. Each GPU gets its own process and a full copy of the model; PyTorch
`DistributedDataParallel` averages the gradients once per optimizer step.

* **Global batch** = batch size × accumulation steps × GPUs. With 2 GPUs, halve the accumulation
  steps to train on the same number of sequences per step as here.
* The loss is normalised by the label tokens of the whole global batch, so 2 GPUs × 2 sequences
  train exactly like 1 GPU × 4 (checked in CI on 2 CPU processes).
* For a model that does not fit on one GPU, stay in one process and spread its layers:
  `FastLanguageModel.from_pretrained(..., device_map="balanced")` (or `--device_map balanced`).
  The layers then run one after another: more memory, not more speed.

The cell below saves this notebook's settings and prints the commands to run in a terminal.'''

SCALE_OUT = '''\
import json, pathlib, shlex

script = pathlib.Path("scripts/train_sft.py")
for parent in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (parent / "scripts" / "train_sft.py").is_file():
        script = parent / "scripts" / "train_sft.py"
        break

run_config = {
    "model_name": cfg.model.model_name,
    "load_in_4bit": cfg.model.load_in_4bit,
    "max_seq_length": cfg.model.max_seq_length,
    "max_length": MAX_LENGTH,
    "chat_template": CHAT_TEMPLATE,
    "r": cfg.lora.r,
    "lora_alpha": cfg.lora.lora_alpha,
    "use_gradient_checkpointing": cfg.lora.use_gradient_checkpointing,
    "learning_rate": cfg.training.learning_rate,
    "max_steps": cfg.training.max_steps,
    "per_device_train_batch_size": cfg.training.per_device_train_batch_size,
    "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
    "warmup_steps": WARMUP_STEPS,
    "n_eval": N_EVAL,
    "seed": SEED,
    "output_dir": f"{OUTPUT_DIR}/scale_out",
}
config_path = pathlib.Path(OUTPUT_DIR) / "run_config.json"
config_path.write_text(json.dumps(run_config, indent=2))
print(f"settings saved to {config_path}:\\n{config_path.read_text()}")
args = f"{shlex.quote(str(script))} --config {shlex.quote(str(config_path))}"
print("one GPU (or CPU):       python", args)
print("2 GPUs, torchrun:       torchrun --nproc_per_node 2", args)
print("2 GPUs, accelerate:     accelerate launch --multi_gpu --num_processes 2", args)
print("too big for one GPU:    python", args, "--device_map balanced")
if not script.is_file():
    print("\\n(scripts/train_sft.py is in the notebookkit repository: clone it, or download that one file.)")'''


# data section: token-length profile -> MAX_LENGTH
PROFILE = '''\
from notebookkit.data import profile_lengths

profile = profile_lengths(train_ds, tokenizer)
print(profile)
profile.plot()
MAX_LENGTH = min(cfg.model.max_seq_length, profile.suggested_max_seq_length)
print("training with max_length =", MAX_LENGTH)
'''

# data section: the SFT trainer with response-only labels, and the masking check
TRAINER = '''\
from notebookkit.data import check_masking
from notebookkit.train import make_sft_trainer

steps = cfg.training.max_steps  # held-back loss is computed every `eval_every` steps (once at the end on CPU)
eval_every = max(1, steps // 2 if ON_GPU else steps) if steps > 0 else None
trainer = make_sft_trainer(
    model, tokenizer, train_ds, heldout_ds, responses_only=True,
    **{**cfg.training.trainer_kwargs(), "output_dir": OUTPUT_DIR, "max_length": MAX_LENGTH,
       "eval_steps": eval_every},
)
check_masking(trainer, n_examples=2)
'''

# held-back answer loss and exact match before training
EVAL_BEFORE = '''\
from notebookkit.train import answer_loss, exact_match, qa_items

heldout_items = qa_items(heldout_ds)
loss_before = answer_loss(model, tokenizer, heldout_items)
em_before = exact_match(model, tokenizer, heldout_items[:N_EXACT], max_new_tokens=24)
print(f"held-back answer loss before training: {loss_before:.3f}")
em_before
'''

# the same measurements after training
EVAL_AFTER = '''\
loss_after = answer_loss(model, tokenizer, heldout_items)
em_after = exact_match(model, tokenizer, heldout_items[:N_EXACT], max_new_tokens=24)
print(f"held-back answer loss: {loss_before:.3f} -> {loss_after:.3f}")
print(f"exact match:          {em_before.score:.0%} -> {em_after.score:.0%}")
em_after
'''


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = tags
    return cell


def setup_cells(parameters_md: str, **parameters: str) -> list[nbformat.NotebookNode]:
    """The parameters cell (``PARAMETERS`` filled with ``parameters``), the resolve cell and the panels."""
    return [
        md(parameters_md),
        code(PARAMETERS.format(**parameters), tags=["parameters"]),
        code(RESOLVE + 'import os\nos.makedirs(OUTPUT_DIR, exist_ok=True)'),
        md(PANELS_MD),
        code(PANELS),
    ]


def training_cells(masking_md: str, before_md: str) -> list[nbformat.NotebookNode]:
    """Trainer + masking check, evaluation before training, calibration, and the training run."""
    return [
        md(masking_md),
        code(TRAINER),
        md(before_md),
        code(EVAL_BEFORE),
        md(CALIBRATION_MD),
        code(CALIBRATION),
        md(TRAIN_MD),
        code(TRAIN),
    ]


# ------------------------------------------------------------------------------------------------
# chat_sft.ipynb


def chat_sft() -> list[nbformat.NotebookNode]:
    return [
        md('''\
# Chat fine-tuning with response-only loss

This notebook teaches a small language model to hold a conversation in a chat format, with LoRA
adapters, on one GPU (a free Colab or Kaggle T4 is enough) or, with the built-in tiny model, on a
laptop CPU in a few minutes.

The steps: choose settings in **panels** → **load** the model and its chat template → add **LoRA**
adapters → prepare the **data** (length profile, response-only labels, masking check, a held-back
split) → a short **calibration** against plain PEFT → **train** with a live dashboard → **evaluate**
on the held-back conversations → **chat** with the tuned model → **save** the adapter.

*Run it top to bottom. On a CPU it uses `notebookkit/tiny-llama`, a small model built and
pre-trained offline on the bundled corpus, so nothing is downloaded.*'''),
        code(INSTALL),
        *setup_cells(
            '''\
**Parameters.** `None` means "choose for this machine": the tiny model and a handful of steps on a
CPU, a real model on a GPU. CI and `make demo` override this cell (it is tagged `parameters`).''',
            chat_template="None",
            chat_template_note='None: guessed from the model name / tokenizer ("llama-3", "chatml", ...)',
            cpu_learning_rate_note="   # the tiny model learns in few steps with a larger rate",
            heldout_rows="conversations",
            slug="chat_sft",
        ),
        md('''\
## 2. Load the model and its chat template

`FastLanguageModel.from_pretrained` loads a Hugging Face checkpoint (4-bit NF4 if chosen) and swaps
the forward passes of its norms, MLPs, attention and loss for fused kernels. The banner lists what
was patched.

A **chat template** turns a list of messages into the exact text the model reads, with markers
around each turn. `get_chat_template` installs one and makes the end-of-turn token the EOS token,
so that generation stops when the assistant's turn ends instead of rambling on.'''),
        code(LOAD.format(chat_template_default="guess_chat_template(tokenizer, cfg.model.model_name)")),
        md(LORA_MD),
        code(LORA),
        md('''\
## 4. Data: conversations, length profile, response-only labels

The bundled dataset stores conversations in ShareGPT style (`from`/`value`). `standardize_sharegpt`
renames them to `role`/`content`, which chat templates read. The bundled data comes with a
**held-back** `eval` split, never trained on, about facts the training conversations do not
mention: it tells us whether the model learned something general rather than memorising. (With your
own data, `notebookkit.train.split_heldout(dataset, n_eval=...)` holds back rows the same way.)'''),
        code('''\
from notebookkit.data import load_bundled, standardize_sharegpt

raw = load_bundled("chat_sharegpt")
print(raw)
print(raw[0]["conversations"][:2])
train_ds = standardize_sharegpt(raw, output_column="messages")
heldout_ds = standardize_sharegpt(load_bundled("chat_sharegpt", split="eval"), output_column="messages")
heldout_ds = heldout_ds.select(range(min(N_EVAL, len(heldout_ds))))
print(f"{len(train_ds)} conversations to train on, {len(heldout_ds)} held back")
print(tokenizer.apply_chat_template(train_ds[0]["messages"], tokenize=False))'''),
        md('''\
**Token-length profile.** Memory for activations and logits grows with the sequence length, so we
pick `max_seq_length` from the data: the 99th percentile of the token counts, rounded up to a
multiple of 64 (about 1 conversation in 100 gets truncated).'''),
        code(PROFILE),
        *training_cells(
            '''\
**Response-only loss.** By default a language model is trained to predict *every* token, including
the user's questions and the system prompt. We only want it to learn the answers, so
`train_on_responses_only` sets the label of every token outside the assistant turns to `-100`
(ignored by the loss). The turn markers are read from the chat template. The assistant's
end-of-turn token stays in the loss: that is how the model learns to stop.

The **masking check** decodes one batch exactly as the trainer will see it: green tokens are
trained on, grey ones are masked. If you see user text in green, the markers are wrong.''',
            '''\
**Before training**, measure the model on the held-back conversations: the *answer loss* (the
average cross-entropy of the reference answers, teacher-forced) and *exact match* (greedy
generation compared with the reference) on a few of them.''',
        ),
        md('''\
## 7. Evaluate on the held-back conversations

The same two measurements as before training. A lower answer loss means the model now puts more
probability on the right answers to questions it never saw in training.'''),
        code(EVAL_AFTER),
        code(LOSS_CURVE),
        md('''\
## 8. Chat with the tuned model

`for_inference` switches to generation mode (KV cache on). The reply streams token by token and
stops at the end-of-turn token thanks to the EOS mapping done with the chat template.'''),
        code('''\
from notebookkit.train import generate_reply

FastLanguageModel.for_inference(model)
conversation = heldout_items[0].messages
print("user:", conversation[-1]["content"])
print("model: ", end="")
reply = generate_reply(model, tokenizer, conversation, max_new_tokens=48, stream=True)
print("reference:", heldout_items[0].reference)'''),
        md(SAVE_MD),
        code(SAVE),
        md(SCALE_OUT_MD),
        code(SCALE_OUT),
        md(SIGNAL_MD),
        code(SIGNAL),
    ]


# ------------------------------------------------------------------------------------------------
# alpaca_sft.ipynb


def alpaca_sft() -> list[nbformat.NotebookNode]:
    return [
        md('''\
# Instruction tuning (Alpaca format)

Instruction tuning teaches a model to follow a request: each example is an *instruction* (plus an
optional *input*) and the desired *output*. This notebook fine-tunes LoRA adapters on the bundled
Alpaca-style rows, rendered with the Alpaca prompt format, and trains only on the responses.

Steps: **panels** → **load** → **LoRA** → **data** (format, length profile, masking check, held-back
split) → **calibration** against plain PEFT → **train** with a live dashboard → **evaluate** on the
held-back instructions → **generate** → **save**.

*On a CPU it uses `notebookkit/tiny-llama` (built offline, nothing is downloaded) and runs in a few
minutes.*'''),
        code(INSTALL),
        *setup_cells(
            '''\
**Parameters.** `None` means "choose for this machine". CI and `make demo` override this cell
(it is tagged `parameters`).''',
            chat_template='"alpaca"',
            chat_template_note='the prompt format; "### Instruction:" / "### Response:" blocks',
            cpu_learning_rate_note="",
            heldout_rows="instructions",
            slug="alpaca_sft",
        ),
        md('''\
## 2. Load the model and the Alpaca prompt format

`FastLanguageModel.from_pretrained` loads the checkpoint and patches it onto fused kernels (see the
banner). The Alpaca format is plain text — a preamble, then `### Instruction:` and `### Response:`
blocks — installed here as a chat template so that the same code renders training examples and
prompts. Each response ends with the tokenizer's EOS token, which is where generation stops.'''),
        code(LOAD.format(chat_template_default='"alpaca"')),
        md(LORA_MD),
        code(LORA),
        md('''\
## 4. Data: instructions, length profile, response-only labels

Each Alpaca row (`instruction`, `input`, `output`) becomes a two-turn conversation: the instruction
(and input, if any) as the user turn, the output as the assistant turn. The bundled `eval` split is
**held back**: never trained on, it measures generalisation. (With your own data,
`notebookkit.train.split_heldout(dataset, n_eval=...)` holds back rows the same way.)'''),
        code('''\
from notebookkit.data import alpaca_to_messages, load_bundled

raw = load_bundled("alpaca")
print(raw)
print(raw[0])
train_ds = raw.map(alpaca_to_messages, remove_columns=raw.column_names)
held = load_bundled("alpaca", split="eval")
heldout_ds = held.map(alpaca_to_messages, remove_columns=held.column_names)
heldout_ds = heldout_ds.select(range(min(N_EVAL, len(heldout_ds))))
print(f"{len(train_ds)} instructions to train on, {len(heldout_ds)} held back")
print(tokenizer.apply_chat_template(train_ds[0]["messages"], tokenize=False))'''),
        md('''\
**Token-length profile**: the suggested `max_seq_length` is the 99th percentile of the token counts,
rounded up to a multiple of 64.'''),
        code(PROFILE),
        *training_cells(
            '''\
**Response-only loss**: labels before `### Response:` (the preamble and the instruction) become
`-100`, so the loss — and every gradient step — is spent on writing responses. The masking check
shows one batch: green is trained on, grey is masked.''',
            '''\
**Before training**: answer loss (teacher-forced cross-entropy of the reference responses) and exact
match of greedy generations on held-back instructions.''',
        ),
        md('''\
## 7. Evaluate on the held-back instructions'''),
        code(EVAL_AFTER),
        code(LOSS_CURVE),
        md('''\
## 8. Follow a new instruction

Generation streams token by token and stops at the EOS token that ends every training response.'''),
        code('''\
from notebookkit.train import generate_reply

FastLanguageModel.for_inference(model)
item = heldout_items[0]
print("instruction:", item.question)
print("response: ", end="")
reply = generate_reply(model, tokenizer, item.messages, max_new_tokens=48, stream=True)
print("reference:", item.reference)'''),
        md(SAVE_MD),
        code(SAVE),
        md(SIGNAL_MD),
        code(SIGNAL),
    ]


# ------------------------------------------------------------------------------------------------
# the export notebook

EXPORT_INTRO = '''\
# Export a fine-tune: LoRA adapter, merged 16-bit model, GGUF for llama.cpp / Ollama

A fine-tune is useful once it leaves the notebook in the form your server reads. This notebook
trains one made-up fact into a model (the **canary**: a password no model knows), exports every
form you pick in the panel below, **reloads each one** and shows one table: form, size on disk,
largest logit difference against the adapter model on a fixed prompt set, whether greedy answers
are equal, and whether the canary fact is still there. An export that silently dropped the LoRA
update, or a GGUF whose chat template no longer reaches the answer, shows up as a missing canary.'''

EXPORT_PARAMETERS = '''\
MODEL_NAME = None          # None: "notebookkit/tiny-llama" on CPU, GPU_MODEL on a GPU
GPU_MODEL = "Qwen/Qwen3-0.6B"
LOAD_IN_4BIT = None        # None: 4-bit on a GPU, 16/32-bit on CPU
LORA_R = 16
CANARY_STEPS = 200         # at most this many steps to learn the canary fact
EXPORT_FORMS = ["lora", "merged_16bit", "gguf"]   # the panel's starting choice
GGUF_METHODS = ["q8_0"]    # f16, bf16, q8_0, q4_0 (notebookkit); q4_k_m, q5_k_m, q6_k (llama.cpp's quantiser)
OUTPUT_DIR = "outputs/export"
SEED = 3407
'''

EXPORT_RESOLVE = '''\
import torch

ON_GPU = torch.cuda.is_available()
MODEL_NAME = MODEL_NAME or (GPU_MODEL if ON_GPU else "notebookkit/tiny-llama")
LOAD_IN_4BIT = ON_GPU if LOAD_IN_4BIT is None else LOAD_IN_4BIT
torch.manual_seed(SEED)
print(f"device: {torch.cuda.get_device_name(0) if ON_GPU else 'CPU'} | model: {MODEL_NAME} | 4-bit: {LOAD_IN_4BIT}")
'''

EXPORT_PANEL_MD = '''\
## 1. What to export

Pick the forms (the adapter alone, the merged 16-bit model that plain `transformers` loads, GGUF
files for llama.cpp / Ollama / LM Studio), the GGUF quantisations (K-quants need
`llama-cpp-python`), how much of the GPU the merge may fill, the folder, and whether to verify.'''

EXPORT_PANEL = '''\
from notebookkit.widgets import ExportPanel

export_panel = ExportPanel(output_dir=OUTPUT_DIR, forms=EXPORT_FORMS, gguf_methods=GGUF_METHODS)
export_panel
'''

EXPORT_TRAIN_MD = '''\
## 2. Load, add adapters, and train the canary fact

`train_canary` runs AdamW on one chat example (loss on the answer only) until greedy decoding
answers with the fact. Before training the model does not know it.'''

EXPORT_TRAIN = '''\
from notebookkit import FastLanguageModel
from notebookkit.export import DEFAULT_CANARY as canary, train_canary

model, tokenizer = FastLanguageModel.from_pretrained(MODEL_NAME, load_in_4bit=LOAD_IN_4BIT)
model = FastLanguageModel.get_peft_model(model, r=LORA_R, lora_alpha=2 * LORA_R, use_gradient_checkpointing=False)
FastLanguageModel.for_inference(model)
known_before = canary.recalled_by(model, tokenizer)
steps = train_canary(model, tokenizer, canary, max_steps=CANARY_STEPS)
print(f"canary known before training: {known_before}; recalled after {steps} steps: {canary.recalled_by(model, tokenizer)}")
'''

EXPORT_RUN_MD = '''\
## 3. Export, reload, compare

Each form is written (the merged model layer by layer, streamed to safetensors shards; GGUF files
with an Ollama `Modelfile` beside them) and, with verification on, reloaded: the merged folder in
plain `transformers`, each GGUF in llama.cpp.'''

EXPORT_RUN = '''\
import pandas as pd
from notebookkit.export import export_and_verify

choice = export_panel.value
rows = export_and_verify(model, tokenizer, canary=canary, **choice.kwargs())
table = pd.DataFrame(rows).drop(columns=["path"])
table
'''

EXPORT_SIGNAL_MD = '''\
## 4. Verdict

The canary was unknown before training and every verified export still recalls it, within the
stated tolerance of the adapter model.'''

EXPORT_SIGNAL = '''\
assert not known_before, "the canary fact was known before training"
for row in rows:
    if "canary" in row:
        assert row["canary"], f"{row['form']} lost the canary fact"
        assert row["within_tolerance"], f"{row['form']} differs from the adapter model beyond its tolerance"
print("every export recalls the canary fact")
'''


def export_notebook() -> list[nbformat.NotebookNode]:
    return [
        md(EXPORT_INTRO),
        code(INSTALL),
        code(EXPORT_PARAMETERS, tags=["parameters"]),
        code(EXPORT_RESOLVE),
        md(EXPORT_PANEL_MD),
        code(EXPORT_PANEL),
        md(EXPORT_TRAIN_MD),
        code(EXPORT_TRAIN),
        md(EXPORT_RUN_MD),
        code(EXPORT_RUN),
        md(EXPORT_SIGNAL_MD),
        code(EXPORT_SIGNAL),
    ]


# ------------------------------------------------------------------------------------------------
# the preference notebook (DPO, or ORPO from the training panel)

DPO_INTRO = """\
# Preference tuning: DPO (or ORPO)

Supervised fine-tuning shows a model good answers; **preference tuning** shows it pairs, a *chosen*
answer and a *rejected* one to the same prompt, and moves probability from the second to the first.
**DPO** (Direct Preference Optimisation) does it against a frozen **reference**: the implicit reward of
an answer is `r = beta * (log pi(answer) - log pi_ref(answer))`, and the loss
`-log sigmoid(r_chosen - r_rejected)` pushes the chosen answer's reward above the rejected one's. With
LoRA the reference costs nothing: it is the same weights with the adapters switched off. **ORPO** (the
other choice in the training panel) needs no reference at all: it adds an odds-ratio term to the SFT
loss of the chosen answer.

Steps: **panels** → **load** → **LoRA** → **preference pairs** → **train** with a live dashboard
(rewards of both answers, their margin, how often the chosen one wins) → **held-back pairs** before
and after → **save**, and a last cell that checks the model learned.

*On a CPU it uses `notebookkit/tiny-llama` (built offline, nothing is downloaded) and runs in a few
minutes.*"""

DPO_PARAMETERS = """\
MODEL_NAME = None          # None: "notebookkit/tiny-llama" on CPU, GPU_MODEL on a GPU
GPU_MODEL = "Qwen/Qwen3-0.6B"
CHAT_TEMPLATE = None       # None: guessed from the model name / tokenizer
LOAD_IN_4BIT = None        # None: 4-bit on a GPU, 16/32-bit on CPU
MAX_SEQ_LENGTH = None      # None: 2048 on a GPU, 256 on CPU
DTYPE = None               # None: bfloat16 where the GPU has it natively, else float16 (a T4)
LORA_R = 16
METHOD = "dpo"             # "dpo" or "orpo" (also a switch in the training panel)
BETA = 0.1                 # DPO: scale of the implicit reward; ORPO: weight of the odds-ratio term
MAX_STEPS = None           # None: 60 on a GPU, CPU_STEPS on CPU
CPU_STEPS = 60
BATCH_SIZE = 8             # preference pairs per step (each pair is two sequences)
GRAD_ACCUM = 1
LEARNING_RATE = None       # None: 5e-5 on a GPU, CPU_LEARNING_RATE on CPU; 0 trains nothing (a control)
CPU_LEARNING_RATE = 5e-4
WARMUP_STEPS = 2
MAX_LENGTH = 128           # tokens of prompt + answer
N_EVAL = 48                # held-back pairs to evaluate on
SEED = 3407
OUTPUT_DIR = "outputs/dpo"
FIRST_LAST = 5             # the last cell compares the first and the last FIRST_LAST logged steps:
MIN_ACCURACY_RISE = 0.15   # ... reward accuracy must rise by at least this (DPO starts at 0: policy = reference)
MIN_MARGIN_RISE = 0.5      # ... and the reward margin by at least this
MIN_NLL_DROP = 0.2         # ORPO: its NLL on the chosen answers must fall by at least this fraction
"""

DPO_RESOLVE = """\
import os
import torch

ON_GPU = torch.cuda.is_available()
MODEL_NAME = MODEL_NAME or (GPU_MODEL if ON_GPU else "notebookkit/tiny-llama")
LOAD_IN_4BIT = ON_GPU if LOAD_IN_4BIT is None else LOAD_IN_4BIT
MAX_SEQ_LENGTH = MAX_SEQ_LENGTH or (2048 if ON_GPU else 256)
MAX_STEPS = MAX_STEPS or (60 if ON_GPU else CPU_STEPS)
LEARNING_RATE = (5e-5 if ON_GPU else CPU_LEARNING_RATE) if LEARNING_RATE is None else LEARNING_RATE
torch.manual_seed(SEED)
os.makedirs(OUTPUT_DIR, exist_ok=True)
print(f"device: {torch.cuda.get_device_name(0) if ON_GPU else 'CPU'} | model: {MODEL_NAME} | "
      f"4-bit: {LOAD_IN_4BIT} | method: {METHOD} | steps: {MAX_STEPS} | learning rate: {LEARNING_RATE}")
"""

DPO_PANELS_MD = """\
## 1. Choose the model, the adapter and the run

The panels hold every setting the rest of the notebook reads. The training panel's **method** switch
picks DPO or ORPO, and **beta** is DPO's reward scale (ORPO's odds-ratio weight). The VRAM estimate
beside the model panel follows every choice; for preference pairs, count each pair as two sequences."""

DPO_PANELS = """\
from notebookkit.widgets import ConfigPanels

panels = ConfigPanels(
    model=dict(model_name=MODEL_NAME, load_in_4bit=LOAD_IN_4BIT, max_seq_length=MAX_SEQ_LENGTH, dtype=DTYPE),
    lora=dict(r=LORA_R, lora_alpha=LORA_R, random_state=SEED),
    training=dict(method=METHOD, beta=BETA, max_steps=MAX_STEPS, per_device_train_batch_size=BATCH_SIZE,
                  gradient_accumulation_steps=GRAD_ACCUM, learning_rate=LEARNING_RATE, warmup_steps=WARMUP_STEPS,
                  seed=SEED),
)
panels
"""

DPO_DATA_MD = """\
## 4. Preference pairs

Each bundled row is a question, the true answer (*chosen*) and a wrong or unhelpful one (*rejected*).
A chat model reads them as conversations, so the prompt becomes a user turn and each answer an
assistant turn; the trainer renders both with the chat template and scores only the answer tokens.
The `eval` split is **held back**: pairs about facts the training rows never mention."""

DPO_DATA = """\
from notebookkit.data import load_bundled

def as_chat(row):
    return {"prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}]}

raw = load_bundled("preference")
print(raw)
print(raw[0])
train_ds = raw.map(as_chat)
heldout_ds = load_bundled("preference", split="eval").map(as_chat)
heldout_ds = heldout_ds.select(range(min(N_EVAL, len(heldout_ds))))
print(f"{len(train_ds)} pairs to train on, {len(heldout_ds)} held back")
"""

DPO_TRAINER_MD = """\
## 5. The trainer

`FastDPOTrainer` and `FastORPOTrainer` are TRL's `DPOTrainer` and `ORPOTrainer` (ORPO lives in
`trl.experimental.orpo` now), used exactly as with TRL; they check the data first (a missing
`prompt` / `chosen` / `rejected` column is named, with the expected format) and, for DPO, make the
reference the model itself with the adapters switched off (`ref_model=None`: no second copy). The
banner line says which reference is used."""

DPO_TRAINER = """\
from trl import DPOConfig
from notebookkit.train import FastDPOTrainer, FastORPOTrainer, ORPOConfig, precision_flags

choice = cfg.training
common = dict(output_dir=OUTPUT_DIR, max_length=MAX_LENGTH, logging_steps=1, report_to="none", save_strategy="no",
              use_cpu=not ON_GPU, dataloader_num_workers=0, **precision_flags(model), **choice.trainer_kwargs())
if choice.method == "orpo":
    trainer = FastORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=train_ds,
                              eval_dataset=heldout_ds, processing_class=tokenizer)
else:
    trainer = FastDPOTrainer(model=model, ref_model=None, args=DPOConfig(**common), train_dataset=train_ds,
                             eval_dataset=heldout_ds, processing_class=tokenizer)
"""

DPO_EVAL_MD = """\
**Before training**, score the held-back pairs: the mean rewards of both answers, their margin and the
fraction of pairs whose chosen answer scores higher. For DPO all of them are 0 before the first update:
the policy *is* the reference."""

DPO_EVAL_BEFORE = """\
def pair_scores(metrics):
    return {k.removeprefix("eval_"): round(v, 4) for k, v in metrics.items()
            if k.startswith(("eval_rewards/", "eval_loss"))}

before = pair_scores(trainer.evaluate())
before
"""

DPO_TRAIN_MD = """\
## 6. Train, with the live dashboard

Beside loss, learning rate, gradient norm and memory, the dashboard plots the implicit **reward** of
the chosen and the rejected answers, their **margin** and the reward **accuracy** (the fraction of
pairs in the step whose chosen answer wins). Training should open the gap: chosen up or steady,
rejected down."""

DPO_EVAL_AFTER_MD = """\
## 7. The held-back pairs after training

The same scores on pairs the model never trained on: a margin and an accuracy above the start mean it
learned to prefer true answers in general, not only the ones it saw."""

DPO_EVAL_AFTER = """\
after = pair_scores(trainer.evaluate())
for key in after:
    print(f"{key:22s} {before.get(key, float('nan')):9.4f} -> {after[key]:9.4f}")
"""

DPO_GENERATE = """\
from notebookkit import FastLanguageModel
from notebookkit.train import generate_reply

FastLanguageModel.for_inference(model)
for row in heldout_ds.select(range(2)):
    print("question: ", row["prompt"][0]["content"])
    print("model:    ", generate_reply(model, tokenizer, row["prompt"], max_new_tokens=24))
    print("chosen:   ", row["chosen"][0]["content"], "| rejected:", row["rejected"][0]["content"])
model = FastLanguageModel.for_training(model)
"""

DPO_SIGNAL_MD = """\
## Last: did it learn? (checked automatically)

CI runs this notebook on the tiny default and this cell fails the run unless the preference was
learned: averaged over the first and the last `FIRST_LAST` logged steps, DPO's reward accuracy must
rise by `MIN_ACCURACY_RISE` and its reward margin by `MIN_MARGIN_RISE`. With the learning rate at 0
the policy stays equal to the reference, every reward stays exactly 0, and this cell fails.

ORPO is checked on what it optimises first: its NLL on the chosen answers must fall by
`MIN_NLL_DROP`. Its rewards have no reference, so they start apart, and on the tiny default its
odds-ratio term is weak: the answers of a pair differ by a word, the log-probabilities are averaged
over the answer, and at `beta = 0.1` that term's gradient is a few hundred times smaller than the
NLL's (measured on the first batch), so in 60 CPU steps the margin does not widen. Its accuracy and
margin are printed, not asserted."""

DPO_SIGNAL = """\
import statistics

steps = [h for h in trainer.state.log_history if "loss" in h and "rewards/margins" in h]
def first_last(key):
    return (statistics.mean(h[key] for h in steps[:FIRST_LAST]), statistics.mean(h[key] for h in steps[-FIRST_LAST:]))

acc_first, acc_last = first_last("rewards/accuracies")
margin_first, margin_last = first_last("rewards/margins")
print(f"reward accuracy {acc_first:.3f} -> {acc_last:.3f} (rise {acc_last - acc_first:+.3f})")
print(f"reward margin   {margin_first:.3f} -> {margin_last:.3f} (rise {margin_last - margin_first:+.3f})")
if cfg.training.method == "orpo":
    nll_first, nll_last = first_last("nll_loss")
    drop = 1 - nll_last / nll_first
    print(f"ORPO NLL on the chosen answers {nll_first:.3f} -> {nll_last:.3f} ({drop:.0%} lower; required {MIN_NLL_DROP:.0%})")
    assert drop >= MIN_NLL_DROP, "ORPO's NLL on the chosen answers did not fall enough: nothing was learned"
else:
    print(f"required: accuracy rise {MIN_ACCURACY_RISE}, margin rise {MIN_MARGIN_RISE}")
    assert acc_last - acc_first >= MIN_ACCURACY_RISE, "the reward accuracy did not rise enough: the preference was not learned"
    assert margin_last - margin_first >= MIN_MARGIN_RISE, "the reward margin did not rise enough: the preference was not learned"
print("learning signal: OK")
"""


def rl_setup_cells(intro: str, parameters: str, resolve: str, panels_md: str, panels: str) -> list[nbformat.NotebookNode]:
    """The first cells of the DPO and GRPO notebooks: title, install, parameters, resolve, panels."""
    return [
        md(intro),
        code(INSTALL),
        md("""\
**Parameters.** `None` means "choose for this machine". CI and `make demo` override this cell (it is
tagged `parameters`)."""),
        code(parameters, tags=["parameters"]),
        code(resolve),
        md(panels_md),
        code(panels),
    ]


def dpo_notebook() -> list[nbformat.NotebookNode]:
    return [
        *rl_setup_cells(DPO_INTRO, DPO_PARAMETERS, DPO_RESOLVE, DPO_PANELS_MD, DPO_PANELS),
        md("""\
## 2. Load the model and its chat template

`FastLanguageModel.from_pretrained` loads the checkpoint and patches it onto fused kernels; the chat
template renders prompts and answers as the model's conversation format."""),
        code(LOAD.format(chat_template_default="guess_chat_template(tokenizer, cfg.model.model_name)")),
        md(LORA_MD),
        code(LORA),
        md(DPO_DATA_MD),
        code(DPO_DATA),
        md(DPO_TRAINER_MD),
        code(DPO_TRAINER),
        md(DPO_EVAL_MD),
        code(DPO_EVAL_BEFORE),
        md(DPO_TRAIN_MD),
        code(TRAIN),
        md(DPO_EVAL_AFTER_MD),
        code(DPO_EVAL_AFTER),
        md("""\
## 8. Ask the tuned model

Greedy answers to two held-back questions, beside the pair's chosen and rejected answers."""),
        code(DPO_GENERATE),
        md(SAVE_MD),
        code(SAVE),
        md(DPO_SIGNAL_MD),
        code(DPO_SIGNAL),
    ]


# ------------------------------------------------------------------------------------------------
# the GRPO notebook: a short SFT priming on the answer format, then GRPO with verifiable rewards

GRPO_INTRO = """\
# Reinforcement learning with verifiable rewards: GRPO

**GRPO** (Group Relative Policy Optimisation) needs no written answers to train on: for each prompt
the model samples a *group* of completions, a program scores each one (here: is the answer in the
asked-for format, and is it right?), and the model is pushed towards the completions that scored
above their group's mean and away from those below it. This is how reasoning models learn from
problems whose answers can be checked.

A model that never writes the format cannot be rewarded for it, so the run starts with a **short SFT
priming** on a few worked solutions, then GRPO takes over with the reward functions.

Steps: **panels** → **load** → **LoRA** → **data** and **reward functions** → **priming** (SFT on the
format) → **GRPO** with a live dashboard (reward per function, completion length, time in generation
vs training) → **held-back problems** → **save**, and a last cell that checks the reward rose.

*On a CPU it uses `notebookkit/tiny-llama` (built offline, nothing is downloaded) and runs in a few
minutes; the tiny model can barely do arithmetic, so its gain is mostly in the format, while a real
model's shows in correctness too.*"""

GRPO_PARAMETERS = """\
MODEL_NAME = None          # None: "notebookkit/tiny-llama" on CPU, GPU_MODEL on a GPU
GPU_MODEL = "Qwen/Qwen3-0.6B"
CHAT_TEMPLATE = None       # None: guessed from the model name / tokenizer
LOAD_IN_4BIT = None        # None: 4-bit on a GPU, 16/32-bit on CPU
MAX_SEQ_LENGTH = None      # None: 1024 on a GPU, 256 on CPU
DTYPE = None               # None: bfloat16 where the GPU has it natively, else float16 (a T4)
LORA_R = 16
PRIME_ROWS = 100           # worked solutions for the SFT priming (held apart from the GRPO prompts)
PRIME_STEPS = None         # None: 30 on a GPU, CPU_PRIME_STEPS on CPU; 0 skips the priming
CPU_PRIME_STEPS = 40
PRIME_LEARNING_RATE = None # None: 2e-4 on a GPU, 5e-3 on CPU
GRPO_STEPS = None          # None: 100 on a GPU, CPU_GRPO_STEPS on CPU
CPU_GRPO_STEPS = 50
PROMPTS_PER_STEP = 4
NUM_GENERATIONS = 8        # completions sampled per prompt: the group
MAX_COMPLETION_LENGTH = None  # None: 256 on a GPU, 24 on CPU
TEMPERATURE = 0.8
TOP_K = 50                 # sample from the 50 likeliest tokens (0: the whole vocabulary)
KL_BETA = 0.0              # > 0 adds a KL term to the reference (the model before GRPO)
LEARNING_RATE = None       # None: 5e-5 on a GPU, CPU_LEARNING_RATE on CPU; 0 trains nothing (a control)
CPU_LEARNING_RATE = 1e-3
WARMUP_STEPS = 3
FORMAT_ROWS = None         # train the embedding rows of the answer tags' tokens too; None: on CPU (the tiny default)
N_EVAL = 8                 # held-back problems answered before the end
SEED = 3407
OUTPUT_DIR = "outputs/grpo"
FIRST_LAST = 10            # the last cell compares the mean reward of the first and the last FIRST_LAST steps:
MIN_REWARD_RISE = 0.25     # ... it must rise by at least this (rewards: format 0 / 0.5 / 1 plus correctness 0 / 1)
"""

GRPO_RESOLVE = """\
import os
import torch

ON_GPU = torch.cuda.is_available()
MODEL_NAME = MODEL_NAME or (GPU_MODEL if ON_GPU else "notebookkit/tiny-llama")
LOAD_IN_4BIT = ON_GPU if LOAD_IN_4BIT is None else LOAD_IN_4BIT
MAX_SEQ_LENGTH = MAX_SEQ_LENGTH or (1024 if ON_GPU else 256)
PRIME_STEPS = (30 if ON_GPU else CPU_PRIME_STEPS) if PRIME_STEPS is None else PRIME_STEPS
PRIME_LEARNING_RATE = PRIME_LEARNING_RATE or (2e-4 if ON_GPU else 5e-3)
GRPO_STEPS = GRPO_STEPS or (100 if ON_GPU else CPU_GRPO_STEPS)
MAX_COMPLETION_LENGTH = MAX_COMPLETION_LENGTH or (256 if ON_GPU else 24)
LEARNING_RATE = (5e-5 if ON_GPU else CPU_LEARNING_RATE) if LEARNING_RATE is None else LEARNING_RATE
FORMAT_ROWS = (not ON_GPU) if FORMAT_ROWS is None else FORMAT_ROWS
torch.manual_seed(SEED)
os.makedirs(OUTPUT_DIR, exist_ok=True)
print(f"device: {torch.cuda.get_device_name(0) if ON_GPU else 'CPU'} | model: {MODEL_NAME} | 4-bit: {LOAD_IN_4BIT} | "
      f"priming steps: {PRIME_STEPS} | GRPO steps: {GRPO_STEPS} | learning rate: {LEARNING_RATE}")
"""

GRPO_PANELS_MD = """\
## 1. Choose the model, the adapter and the run

The training panel holds the GRPO run: its **batch size** counts completions (prompts per step ×
generations per prompt) and **KL beta** weighs a KL term to the reference (0: none, and then no
reference is computed). Generation settings (group size, completion length, sampling) are in the
parameters cell."""

GRPO_PANELS = """\
from notebookkit.widgets import ConfigPanels

panels = ConfigPanels(
    model=dict(model_name=MODEL_NAME, load_in_4bit=LOAD_IN_4BIT, max_seq_length=MAX_SEQ_LENGTH, dtype=DTYPE),
    lora=dict(r=LORA_R, lora_alpha=LORA_R, random_state=SEED),
    training=dict(method="grpo", beta=KL_BETA, max_steps=GRPO_STEPS,
                  per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS, gradient_accumulation_steps=1,
                  learning_rate=LEARNING_RATE, warmup_steps=WARMUP_STEPS, seed=SEED),
)
panels
"""

GRPO_DATA_MD = """\
## 4. Problems and reward functions

Each bundled row has a `prompt` (a system turn asking for one line of working and the final number in
`<answer></answer>` tags, and the problem), the reference `answer`, and a worked `solution`. GRPO
reads the `prompt`; the other columns reach the reward functions by name. The `eval` split is held
back."""

GRPO_DATA = """\
from notebookkit.data import load_bundled

raw = load_bundled("grpo_math")
print(raw)
print(raw[0]["prompt"][0]["content"])
print(raw[0]["prompt"][1]["content"], "->", raw[0]["answer"])
prime_ds = raw.select(range(PRIME_ROWS))
grpo_ds = raw.select(range(PRIME_ROWS, len(raw)))
heldout_ds = load_bundled("grpo_math", split="eval").select(range(N_EVAL))
print(f"{len(prime_ds)} worked solutions for the priming, {len(grpo_ds)} prompts for GRPO, {len(heldout_ds)} held back")
"""

GRPO_REWARDS_MD = """\
**Reward functions** follow TRL's convention: `fn(prompts, completions, **columns) -> list[float]`,
called once per batch with the prompts and completions (chat turns here) and every other column of
the rows (`answer`, `question`, `solution`) as lists aligned with the completions; one score per
completion comes back (`None` where a function does not apply). Two ship with notebookkit:

* `format_reward`: 1.0 for exactly one line of working, a newline and `<answer>N</answer>`; 0.5 for an
  answer tag anywhere; 0 otherwise;
* `correctness_reward`: 1.0 when the tagged number equals the row's `answer`.

Write your own the same way (see `help(notebookkit.train.rewards)`): name the columns you need, end
with `**kwargs`. The trainer checks each function's parameters against the data set before training,
and a function that raises or returns the wrong number of scores is reported with its name and the
offending row. Below, both rewards score a worked solution and a rambling reply, and a third,
home-made one shows the shape."""

GRPO_REWARDS = """\
from notebookkit.train import completion_text, correctness_reward, format_reward

def short_reply_reward(completions, **kwargs):  # a home-made example (not used below)
    return [0.2 if completion_text(c).count("\\n") <= 1 else 0.0 for c in completions]  # at most two lines

samples = [[{"role": "assistant", "content": raw[0]["solution"]}],
           [{"role": "assistant", "content": "Let me think. Max has some marbles and then more."}]]
answers = [raw[0]["answer"]] * 2
for fn in (format_reward, correctness_reward, short_reply_reward):
    print(f"{fn.__name__:20s}", fn(prompts=[raw[0]["prompt"]] * 2, completions=samples, answer=answers))
reward_funcs = [format_reward, correctness_reward]
"""

GRPO_PRIME_MD = """\
## 5. Priming: a short SFT run on the answer format

A few worked solutions, trained as prompt → completion, teach the shape of an answer; the priming is
kept short on purpose, so that the format is half there and GRPO has something to learn.

One more step is needed on the tiny default: it never saw `<`, `>`, `/` or its end-of-turn token in
pre-training, so their embedding rows are near-copies of each other and no adapter can make the model
write one rather than another. `untrained_tokens` finds such rows among the tokens of the solutions,
and `train_token_rows` trains exactly those rows (here with the other tokens of the tags,
`FORMAT_ROWS`) alongside the adapters, in the priming and in GRPO. A real checkpoint usually has no
such rows among these tokens: on a GPU the list is then empty and this changes nothing. The trained
rows are part of the base weights from then on (save the model, not only the adapter, to keep them;
a KL reference shares them)."""

GRPO_PRIME = """\
from notebookkit.train import make_sft_trainer, train_token_rows, untrained_tokens

prime_rows = prime_ds.map(lambda row: {"completion": [{"role": "assistant", "content": row["solution"]}]},
                          remove_columns=["question", "answer", "solution"])
token_rows = set(untrained_tokens(model, tokenizer, list(prime_ds["solution"]) + [tokenizer.eos_token]))
if FORMAT_ROWS:
    token_rows |= set(tokenizer("<answer></answer>", add_special_tokens=False)["input_ids"])
token_rows = sorted(token_rows)
print(f"embedding rows trained with the adapters: {tokenizer.convert_ids_to_tokens(token_rows)}")
if PRIME_STEPS:
    priming = make_sft_trainer(model, tokenizer, prime_rows, max_steps=PRIME_STEPS, learning_rate=PRIME_LEARNING_RATE,
                               per_device_train_batch_size=8, gradient_accumulation_steps=1, warmup_steps=1,
                               weight_decay=0.0, max_length=192, seed=SEED, output_dir=f"{OUTPUT_DIR}/priming")
    with train_token_rows(model, token_rows):
        priming.train()
    losses = [h["loss"] for h in priming.state.log_history if "loss" in h]
    print(f"priming: {PRIME_STEPS} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
"""

GRPO_TRAINER_MD = """\
## 6. GRPO, with the live dashboard

`FastGRPOTrainer` is TRL's `GRPOTrainer`, used exactly as with TRL. Completions come from the model's
own `generate`, switched into `FastLanguageModel.for_inference` for the call and back to training
afterwards; the time spent in generation, in scoring (rewards, log-probs) and in training is logged
per step. The dashboard adds the mean reward with its spread, each reward function's mean, the
completion length and those times (and KL when `KL_BETA > 0`)."""

GRPO_TRAINER = """\
from trl import GRPOConfig
from transformers import ProgressCallback
from notebookkit.train import FastGRPOTrainer, precision_flags
from notebookkit.widgets import LiveDashboard

config = GRPOConfig(
    output_dir=OUTPUT_DIR, num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION_LENGTH,
    temperature=TEMPERATURE, top_k=TOP_K, logging_steps=1, report_to="none", save_strategy="no",
    use_cpu=not ON_GPU, dataloader_num_workers=0, **precision_flags(model), **cfg.training.trainer_kwargs(),
)
trainer = FastGRPOTrainer(model=model, reward_funcs=reward_funcs, args=config, train_dataset=grpo_ds,
                          processing_class=tokenizer)
dashboard = LiveDashboard(title="GRPO")
trainer.remove_callback(ProgressCallback)
trainer.add_callback(dashboard)
with train_token_rows(model, token_rows):  # weight_decay is 0 (TRL's default): the other rows stay as they are
    train_result = trainer.train()
dashboard.save_figure(f"{OUTPUT_DIR}/dashboard.png")
times = {k: sum(h.get(k, 0.0) for h in trainer.state.log_history) for k in ("time/generation", "time/scoring", "time/training")}
print(f"trained {train_result.global_step} steps in {train_result.metrics['train_runtime']:.0f} s: " +
      ", ".join(f"{k.split('/')[1]} {v:.0f} s" for k, v in times.items()))
"""

GRPO_HELDOUT_MD = """\
## 7. Held-back problems

Greedy answers to problems the model never saw, with both rewards. The tiny default learns the
format (its greedy answers are well formed) but not the arithmetic, and its answers tend to repeat
one line whatever the question: the reward asked for the format, and the format is what it got. A
real model, with a correctness reward it can reach, learns both."""

GRPO_HELDOUT = """\
from notebookkit import FastLanguageModel
from notebookkit.train import generate_reply

FastLanguageModel.for_inference(model)
for row in heldout_ds:
    reply = generate_reply(model, tokenizer, row["prompt"], max_new_tokens=MAX_COMPLETION_LENGTH)
    done = [[{"role": "assistant", "content": reply}]]
    print(f"{row['question']!r} -> {reply!r} | format {format_reward(done)[0]} | "
          f"correct {correctness_reward(done, answer=[row['answer']])[0]} (answer {row['answer']})")
model = FastLanguageModel.for_training(model)
"""

GRPO_SIGNAL_MD = """\
## Last: did the reward rise? (checked automatically)

CI runs this notebook on the tiny default and this cell fails the run unless GRPO raised the mean
reward of the sampled completions: the mean over the last `FIRST_LAST` steps must exceed the mean over
the first `FIRST_LAST` by `MIN_REWARD_RISE`. With the learning rate at 0 the policy stays the primed
model, the reward only fluctuates, and this cell fails."""

GRPO_SIGNAL = """\
import statistics

rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h and "loss" in h]
first, last = statistics.mean(rewards[:FIRST_LAST]), statistics.mean(rewards[-FIRST_LAST:])
print(f"mean reward, first {FIRST_LAST} steps {first:.3f} -> last {FIRST_LAST} steps {last:.3f} "
      f"(rise {last - first:+.3f}; required {MIN_REWARD_RISE})")
for name in ("format_reward", "correctness_reward"):
    values = [h[f"rewards/{name}/mean"] for h in trainer.state.log_history if f"rewards/{name}/mean" in h]
    print(f"  {name}: {statistics.mean(values[:FIRST_LAST]):.3f} -> {statistics.mean(values[-FIRST_LAST:]):.3f}")
assert last - first >= MIN_REWARD_RISE, f"the mean reward rose only {last - first:+.3f} (< {MIN_REWARD_RISE})"
print("learning signal: OK")
"""


def grpo_notebook() -> list[nbformat.NotebookNode]:
    return [
        *rl_setup_cells(GRPO_INTRO, GRPO_PARAMETERS, GRPO_RESOLVE, GRPO_PANELS_MD, GRPO_PANELS),
        md("""\
## 2. Load the model and its chat template"""),
        code(LOAD.format(chat_template_default="guess_chat_template(tokenizer, cfg.model.model_name)")),
        md(LORA_MD),
        code(LORA),
        md(GRPO_DATA_MD),
        code(GRPO_DATA),
        md(GRPO_REWARDS_MD),
        code(GRPO_REWARDS),
        md(GRPO_PRIME_MD),
        code(GRPO_PRIME),
        md(GRPO_TRAINER_MD),
        code(GRPO_TRAINER),
        md(GRPO_HELDOUT_MD),
        code(GRPO_HELDOUT),
        md(SAVE_MD),
        code(SAVE),
        md(GRPO_SIGNAL_MD),
        code(GRPO_SIGNAL),
    ]


# ------------------------------------------------------------------------------------------------
# vision_sft.ipynb

VISION_INTRO = '''\
# Vision fine-tuning: teach a vision-language model to caption images

A vision-language model (VLM) reads an image as a few dozen to a few thousand *image tokens*: a
vision tower turns patches of pixels into features, a projector maps them into the language model's
embedding space, and the language decoder reads them like words. This notebook fine-tunes LoRA
adapters on both the vision tower and the decoder so that the model describes an image in one
sentence, and checks on **held-out images** whether it learned to *see* the colour and the shape.

Steps: **panels** → **load** the model and its processor → **LoRA** on the vision and language
layers → **data** (images with captions, the collator, the masking check) → **captions before
training** → **train** with a live dashboard → **captions after training** → **save** the adapter
and **export** the merged model → the learning check.

*On a CPU it uses `notebookkit/tiny-qwen2.5-vl`: a small Qwen2.5-VL model (the family of the GPU
default) built offline with random weights, so nothing is downloaded. It starts out unable to
caption at all; a CPU run of a minute teaches it the caption format and to read the colour off the
image (shapes need a longer run or a real vision tower). On a GPU it uses Qwen2.5-VL 7B.*'''

VISION_PARAMETERS = '''\
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
BATCH_SIZE = 8
GRAD_ACCUM = 1
LEARNING_RATE = None       # None: 2e-4 on a GPU, CPU_LEARNING_RATE on CPU
CPU_LEARNING_RATE = 5e-3   # the tiny model learns in few steps with a larger rate
WARMUP_STEPS = 10
N_EVAL = 60                # held-out images to caption before and after training (the whole eval split)
SEED = 3407
OUTPUT_DIR = "outputs/vision_sft"
EXPORT_MERGED = True       # also write the merged 16-bit model (notebookkit.export) and reload it
MIN_LOSS_DROP = 0.2        # the last cell asserts the training loss fell by at least this fraction
MIN_ACCURACY_GAIN = 0.25   # ... and the held-out caption accuracy rose by at least this much
'''

VISION_RESOLVE = '''\
import os
import torch

ON_GPU = torch.cuda.is_available()
MODEL_NAME = MODEL_NAME or (GPU_MODEL if ON_GPU else "notebookkit/tiny-qwen2.5-vl")
LOAD_IN_4BIT = ON_GPU if LOAD_IN_4BIT is None else LOAD_IN_4BIT
MAX_SEQ_LENGTH = MAX_SEQ_LENGTH or (2048 if ON_GPU else 256)
MAX_STEPS = MAX_STEPS or (60 if ON_GPU else CPU_STEPS)
LEARNING_RATE = LEARNING_RATE if LEARNING_RATE is not None else (2e-4 if ON_GPU else CPU_LEARNING_RATE)
torch.manual_seed(SEED)
os.makedirs(OUTPUT_DIR, exist_ok=True)
print(f"device: {torch.cuda.get_device_name(0) if ON_GPU else 'CPU'} | model: {MODEL_NAME} | "
      f"4-bit: {LOAD_IN_4BIT} | steps: {MAX_STEPS} | learning rate: {LEARNING_RATE}")
'''


VISION_LOAD = '''\
cfg = panels.value  # the panels' current values
from notebookkit import FastVisionModel

model, processor = FastVisionModel.from_pretrained(**cfg.model.from_pretrained_kwargs())
'''

VISION_LORA = '''\
model = FastVisionModel.get_peft_model(
    model,
    finetune_vision_layers=FINETUNE_VISION_LAYERS,
    finetune_language_layers=FINETUNE_LANGUAGE_LAYERS,
    finetune_attention_modules=True,
    finetune_mlp_modules=True,
    r=cfg.lora.r, lora_alpha=cfg.lora.lora_alpha, lora_dropout=cfg.lora.lora_dropout, bias=cfg.lora.bias,
    use_gradient_checkpointing=cfg.lora.use_gradient_checkpointing, random_state=cfg.lora.random_state,
)
'''

VISION_DATA = '''\
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
    ax.set_title(row["caption"].replace(" on a ", "\\non a ", 1), fontsize=7)
fig.suptitle(f"{len(train_ds)} training images, {len(heldout_ds)} held out (colour/shape pairs never shown in training)")
fig.tight_layout()
'''

VISION_COLLATOR = '''\
from notebookkit.data import VisionDataCollator
from notebookkit.data.masking import masking_report_from_batch

collator = VisionDataCollator(model, processor)
print(f"checked {collator.check(train_ds)} training rows: every image decodes, one image per image item")
batch = collator([train_ds[i] for i in range(2)])
print({k: tuple(v.shape) for k, v in batch.items()})
masking_report_from_batch(batch, processor.tokenizer, max_examples=2)
'''

VISION_BEFORE = '''\
from notebookkit.embedded.caption_scores import score_captions
from notebookkit.models.vision_generate import generate_vision_replies

heldout_rows = [heldout_ds[i] for i in range(len(heldout_ds))]
train_reference = [{"colour": c, "shape": s} for c, s in zip(train_ds["colour"], train_ds["shape"])]
captions_before = generate_vision_replies(model, processor, heldout_rows, max_new_tokens=20)
score_before = score_captions(captions_before, heldout_rows, train_reference)
print("before training:", score_before)
for reference, generated, verdict in score_before.rows[:4]:
    print(f"  reference: {reference}\\n  generated: {generated!r} ({verdict})")
'''

VISION_TRAINER = '''\
from notebookkit.train import sft_config
from notebookkit.train.sft import FastSFTTrainer

args = sft_config(
    OUTPUT_DIR, model=model, max_length=None, **cfg.training.trainer_kwargs(),
    remove_unused_columns=False,                      # the collator needs the messages and images columns
    dataset_kwargs={"skip_prepare_dataset": True},    # ... as they are: it renders and tokenises them itself
)
trainer = FastSFTTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator,
                         processing_class=processor)
'''

VISION_AFTER = '''\
import matplotlib.pyplot as plt

captions_after = generate_vision_replies(model, processor, heldout_rows, max_new_tokens=20)
score_after = score_captions(captions_after, heldout_rows, train_reference)
print("before training:", score_before)
print("after training: ", score_after)
fig, axes = plt.subplots(1, 6, figsize=(13, 3.2))
for ax, row, before, after in zip(axes, heldout_rows, captions_before, captions_after):
    ax.imshow(row["image"]); ax.set_axis_off()
    ax.set_title(f"before: {before[:28]!r}\\nafter: {after[:40]}\\ntrue: {row['colour']} {row['shape']}", fontsize=6)
fig.tight_layout(); fig.savefig(f"{OUTPUT_DIR}/captions.png", dpi=100)
'''

VISION_SAVE = '''\
import pathlib

adapter_dir = f"{OUTPUT_DIR}/lora_adapter"
model.save_pretrained(adapter_dir)
processor.save_pretrained(adapter_dir)
print("adapter:", sorted(p.name for p in pathlib.Path(adapter_dir).iterdir()))
if EXPORT_MERGED:
    merged_dir = f"{OUTPUT_DIR}/merged_16bit"
    print(model.save_pretrained_merged(merged_dir, processor.tokenizer, save_method="merged_16bit"))
    processor.save_pretrained(merged_dir)
    merged, _ = FastVisionModel.from_pretrained(merged_dir, max_seq_length=cfg.model.max_seq_length,
                                                load_in_4bit=False, dtype=cfg.model.dtype, show_banner=False)
    sample = {k: v.to(merged.device) for k, v in collator(heldout_rows[:2]).items() if k != "labels"}
    FastVisionModel.for_inference(model); FastVisionModel.for_inference(merged)
    with torch.no_grad():
        gap = (model(**sample).logits.float() - merged(**sample).logits.float()).abs().max().item()
    print(f"merged model reloaded: largest logit difference against the adapter model {gap:.2e}")
    del merged
'''

VISION_SIGNAL_MD = '''\
## Last: did it learn to see? (checked automatically)

CI runs this notebook on the tiny default and this cell fails the run unless the model learned:
the training loss must fall by at least `MIN_LOSS_DROP` (first three logged steps against the last
three), and the held-out caption accuracy (exact match of the colour and shape words) must rise by
at least `MIN_ACCURACY_GAIN` and end above the level of always naming the most frequent colour and
shape. The held-out images pair colours and shapes that no training image shows together, so the
model cannot score by remembering pairs. With `LEARNING_RATE = 0` the check fails: the model never
learns the caption format, and scores 0.'''

VISION_SIGNAL = '''\
import statistics

losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
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
'''


def vision_sft() -> list[nbformat.NotebookNode]:
    return [
        md(VISION_INTRO),
        code(INSTALL),
        md('''\
**Parameters.** `None` means "choose for this machine": the tiny model and a few hundred steps on a
CPU, Qwen2.5-VL 7B in 4-bit on a GPU. CI overrides this cell (it is tagged `parameters`).'''),
        code(VISION_PARAMETERS, tags=["parameters"]),
        code(VISION_RESOLVE),
        md(PANELS_MD),
        code(PANELS),
        md('''\
## 2. Load the model and its processor

`FastVisionModel.from_pretrained` returns the model and its **processor**: the chat template, the
tokenizer and the image processor (resizing and normalising the pixels, cutting them into patches).
The banner says what runs fused: the language decoder is on the same kernels as
`FastLanguageModel` (RMSNorm, RoPE, LoRA QKV/O and MLP, the fused cross-entropy, the memory
planner); in the vision tower its RMSNorms and gated MLPs where it has them, the rest stock.'''),
        code(VISION_LOAD),
        md('''\
## 3. Add LoRA adapters to the vision and language layers

The four switches pick the layers: the vision tower (and its projector) and/or the language decoder,
their attention and/or MLP projections. Adapting the vision tower lets the model learn new visual
features; adapting the decoder teaches it what to say about them.'''),
        code(VISION_LORA),
        md('''\
## 4. Data: images with captions

The bundled set has 64x64 images of one coloured shape each, with a caption, in the layout TRL and
the most used vision notebooks use: `messages` (the user turn holds an `{"type": "image"}` item and
the question, the assistant turn the caption) and the image (`images` in TRL's layout; a single
`image` column works too).'''),
        code(VISION_DATA),
        md('''\
**The collator and the masking check.** `VisionDataCollator` renders each conversation with the chat
template, lets the processor expand the image item into the model's image tokens and prepare the
pixels, and keeps labels only on the caption (and the end-of-turn token, so the model learns to
stop): the question, the image tokens and the padding are `-100`. Green is trained, grey masked.'''),
        code(VISION_COLLATOR),
        md('''\
## 5. Captions before training

The model captions the held-out images (greedy decoding). A caption scores when its colour and shape
words are exactly the true ones.'''),
        code(VISION_BEFORE),
        md('''\
## 6. Train, with the live dashboard

TRL's `SFTTrainer` (notebookkit's `FastSFTTrainer`: the loss runs the fused cross-entropy) with the
collator; the dataset rows reach it untouched.'''),
        code(VISION_TRAINER),
        code(TRAIN),
        md('''\
## 7. Captions after training, on the held-out images'''),
        code(VISION_AFTER),
        code(LOSS_CURVE),
        md('''\
## 8. Save the adapter, export the merged model

The adapter holds only the LoRA matrices; `FastVisionModel.from_pretrained("<adapter folder>")`
loads base + adapter again. `save_pretrained_merged` (notebookkit.export) writes the model with the
adapter merged into 16-bit weights, which plain `transformers` loads; it is reloaded here and
compared with the adapter model. (GGUF export is for text models only.)'''),
        code(VISION_SAVE),
        md(VISION_SIGNAL_MD),
        code(VISION_SIGNAL),
    ]


NOTEBOOKS = {
    "notebooks/sft/chat_sft.ipynb": chat_sft,
    "notebooks/sft/alpaca_sft.ipynb": alpaca_sft,
    "notebooks/export/export.ipynb": export_notebook,
    "notebooks/dpo/dpo.ipynb": dpo_notebook,
    "notebooks/grpo/grpo.ipynb": grpo_notebook,
    "notebooks/vision/vision_sft.ipynb": vision_sft,
}


def build(cells: list[nbformat.NotebookNode], slug: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",
        "colab": {"provenance": []},
    }
    for i, cell in enumerate(cells):
        cell["id"] = f"{slug}-{i:02d}"
    nb.cells = cells
    nbformat.validate(nb)
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a notebook is out of date")
    args = parser.parse_args()
    stale = []
    for rel, make in NOTEBOOKS.items():
        path = ROOT / rel
        text = nbformat.writes(build(make(), path.stem.replace("_", "-"))) + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print("wrote", rel)
    if stale:
        print("out of date (run scripts/make_notebooks.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
