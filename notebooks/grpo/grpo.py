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
# # Reinforcement learning with verifiable rewards: GRPO
#
# **GRPO** (Group Relative Policy Optimisation) needs no written answers to train on: for each prompt
# the model samples a *group* of completions, a program scores each one (here: is the answer in the
# asked-for format, and is it right?), and the model is pushed towards the completions that scored
# above their group's mean and away from those below it. This is how reasoning models learn from
# problems whose answers can be checked.
#
# A model that never writes the format cannot be rewarded for it, so the run starts with a **short SFT
# priming** on a few worked solutions, then GRPO takes over with the reward functions.
#
# Steps: **panels** → **load** → **LoRA** → **data** and **reward functions** → **priming** (SFT on the
# format) → **GRPO** with a live dashboard (reward per function, completion length, time in generation
# vs training) → **held-back problems** → **save**, and a last cell that checks the reward rose.
#
# *On a CPU it uses `notebookkit/tiny-llama` (built offline, nothing is downloaded) and runs in a few
# minutes; the tiny model can barely do arithmetic, so its gain is mostly in the format, while a real
# model's shows in correctness too.*

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
# **Parameters.** `None` means "choose for this machine". CI and `make demo` override this cell (it is
# tagged `parameters`).

# %% tags=["parameters"]
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

# %%
from notebookkit.notebook_cells import apply_script_arguments, resolve_parameters

apply_script_arguments(globals())  # run as a script: --config FILE and --NAME VALUE flags (in Jupyter: nothing)
ON_GPU = resolve_parameters(
    globals(),
    gpu=dict(MODEL_NAME=GPU_MODEL, LOAD_IN_4BIT=True, MAX_SEQ_LENGTH=1024, PRIME_STEPS=30, PRIME_LEARNING_RATE=2e-4,
             GRPO_STEPS=100, MAX_COMPLETION_LENGTH=256, LEARNING_RATE=5e-5, FORMAT_ROWS=False),
    cpu=dict(MODEL_NAME="notebookkit/tiny-llama", LOAD_IN_4BIT=False, MAX_SEQ_LENGTH=256, PRIME_STEPS=CPU_PRIME_STEPS,
             PRIME_LEARNING_RATE=5e-3, GRPO_STEPS=CPU_GRPO_STEPS, MAX_COMPLETION_LENGTH=24,
             LEARNING_RATE=CPU_LEARNING_RATE, FORMAT_ROWS=True),
)

# %% [markdown]
# ## 1. Choose the model, the adapter and the run
#
# The training panel holds the GRPO run: its **batch size** counts completions (prompts per step ×
# generations per prompt) and **KL beta** weighs a KL term to the reference (0: none, and then no
# reference is computed). Generation settings (group size, completion length, sampling) are in the
# parameters cell.

# %%
from notebookkit.widgets import ConfigPanels

panels = ConfigPanels(
    model=dict(model_name=MODEL_NAME, load_in_4bit=LOAD_IN_4BIT, max_seq_length=MAX_SEQ_LENGTH, dtype=DTYPE),
    lora=dict(r=LORA_R, lora_alpha=LORA_R, random_state=SEED),
    training=dict(method="grpo", beta=KL_BETA, max_steps=GRPO_STEPS,
                  per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS, gradient_accumulation_steps=1,
                  learning_rate=LEARNING_RATE, warmup_steps=WARMUP_STEPS, seed=SEED),
)
panels

# %% [markdown]
# ## 2. Load the model and its chat template

# %%
cfg = panels.value  # the panels' current values
from notebookkit import FastLanguageModel
from notebookkit.data import install_chat_template

model, tokenizer = FastLanguageModel.from_pretrained(**cfg.model.from_pretrained_kwargs())
# CHAT_TEMPLATE None: guessed, or the tokenizer's own for a family notebookkit writes no format of (gpt-oss)
CHAT_TEMPLATE = install_chat_template(tokenizer, model, CHAT_TEMPLATE, cfg.model.model_name)
print(f"chat template: {CHAT_TEMPLATE or 'the one its tokenizer ships'}; generation stops at {tokenizer.eos_token!r}")

# %% [markdown]
# ## 3. Add LoRA adapters
#
# LoRA freezes the pretrained weight `W` and learns a low-rank update: a projection computes
# `y = x Wᵀ + (α / r) · x Aᵀ Bᵀ` with `A` of shape `r × in` and `B` of shape `out × r`. `B` starts at
# zero, so training starts from exactly the pretrained model, and only `A` and `B` (well under 1 % of
# the parameters here) get gradients and optimizer state. With dropout 0 and bias `"none"` the
# adapters run inside notebookkit's fused kernels; the banner says which layers do.

# %%
model = FastLanguageModel.get_peft_model(model, **cfg.lora.peft_kwargs())

# %% [markdown]
# ## 4. Problems and reward functions
#
# Each bundled row has a `prompt` (a system turn asking for one line of working and the final number in
# `<answer></answer>` tags, and the problem), the reference `answer`, and a worked `solution`. GRPO
# reads the `prompt`; the other columns reach the reward functions by name. The `eval` split is held
# back.

# %%
from notebookkit.data import load_bundled

raw = load_bundled("grpo_math")
print(raw)
print(raw[0]["prompt"][0]["content"])
print(raw[0]["prompt"][1]["content"], "->", raw[0]["answer"])
prime_ds = raw.select(range(PRIME_ROWS))
grpo_ds = raw.select(range(PRIME_ROWS, len(raw)))
heldout_ds = load_bundled("grpo_math", split="eval").select(range(N_EVAL))
print(f"{len(prime_ds)} worked solutions for the priming, {len(grpo_ds)} prompts for GRPO, {len(heldout_ds)} held back")

# %% [markdown]
# **Reward functions** follow TRL's convention: `fn(prompts, completions, **columns) -> list[float]`,
# called once per batch with the prompts and completions (chat turns here) and every other column of
# the rows (`answer`, `question`, `solution`) as lists aligned with the completions; one score per
# completion comes back (`None` where a function does not apply). Two ship with notebookkit:
#
# * `format_reward`: 1.0 for exactly one line of working, a newline and `<answer>N</answer>`; 0.5 for an
#   answer tag anywhere; 0 otherwise;
# * `correctness_reward`: 1.0 when the tagged number equals the row's `answer`.
#
# Write your own the same way (see `help(notebookkit.train.rewards)`): name the columns you need, end
# with `**kwargs`. The trainer checks each function's parameters against the data set before training,
# and a function that raises or returns the wrong number of scores is reported with its name and the
# offending row. Below, both rewards score a worked solution and a rambling reply, and a third,
# home-made one shows the shape.

# %%
from notebookkit.train import completion_text, correctness_reward, format_reward

def short_reply_reward(completions, **kwargs):  # a home-made example (not used below)
    return [0.2 if completion_text(c).count("\n") <= 1 else 0.0 for c in completions]  # at most two lines

samples = [[{"role": "assistant", "content": raw[0]["solution"]}],
           [{"role": "assistant", "content": "Let me think. Max has some marbles and then more."}]]
answers = [raw[0]["answer"]] * 2
for fn in (format_reward, correctness_reward, short_reply_reward):
    print(f"{fn.__name__:20s}", fn(prompts=[raw[0]["prompt"]] * 2, completions=samples, answer=answers))
reward_funcs = [format_reward, correctness_reward]

# %% [markdown]
# ## 5. Priming: a short SFT run on the answer format
#
# A few worked solutions, trained as prompt → completion, teach the shape of an answer; the priming is
# kept short on purpose, so that the format is half there and GRPO has something to learn.
#
# One more step is needed on the tiny default: it never saw `<`, `>`, `/` or its end-of-turn token in
# pre-training, so their embedding rows are near-copies of each other and no adapter can make the model
# write one rather than another. `untrained_tokens` finds such rows among the tokens of the solutions,
# and `train_token_rows` trains exactly those rows (here with the other tokens of the tags,
# `FORMAT_ROWS`) alongside the adapters, in the priming and in GRPO. A real checkpoint usually has no
# such rows among these tokens: on a GPU the list is then empty and this changes nothing. The trained
# rows are part of the base weights from then on (save the model, not only the adapter, to keep them;
# a KL reference shares them).

# %%
from notebookkit.train import make_sft_trainer, train_token_rows, untrained_tokens
from notebookkit.widgets import LiveDashboard

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
    priming_dashboard = LiveDashboard(title="SFT priming").attach(priming)
    with train_token_rows(model, token_rows):
        prime_result = priming.train()
    losses = [h["loss"] for h in priming.state.log_history if "loss" in h]
    print(f"priming: {PRIME_STEPS} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if priming.args.fp16:  # fp16 trains under a loss scaler, which skips a step whose gradients overflow
        print(f"fp16: {priming_dashboard.skipped_steps} of {prime_result.global_step} optimizer steps skipped "
              "for inf/NaN gradients (SFT priming)")

# %% [markdown]
# ## 6. GRPO, with the live dashboard
#
# `FastGRPOTrainer` is TRL's `GRPOTrainer`, used exactly as with TRL. Completions come from the model's
# own `generate`, switched into `FastLanguageModel.for_inference` for the call and back to training
# afterwards; the time spent in generation, in scoring (rewards, log-probs) and in training is logged
# per step. The dashboard adds the mean reward with its spread, each reward function's mean, the
# completion length and those times (and KL when `KL_BETA > 0`).

# %%
from trl import GRPOConfig
from notebookkit.train import FastGRPOTrainer, precision_flags

config = GRPOConfig(
    output_dir=OUTPUT_DIR, num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION_LENGTH,
    temperature=TEMPERATURE, top_k=TOP_K, logging_steps=1, report_to="none", save_strategy="no",
    use_cpu=not ON_GPU, dataloader_num_workers=0, **precision_flags(model), **cfg.training.trainer_kwargs(),
)
trainer = FastGRPOTrainer(model=model, reward_funcs=reward_funcs, args=config, train_dataset=grpo_ds,
                          processing_class=tokenizer)
dashboard = LiveDashboard(title="GRPO").attach(trainer)  # in place of the trainer's "Step | Training Loss" table
with train_token_rows(model, token_rows):  # weight_decay is 0 (TRL's default): the other rows stay as they are
    train_result = trainer.train()
dashboard.save_figure(f"{OUTPUT_DIR}/dashboard.png")
times = {k: sum(h.get(k, 0.0) for h in trainer.state.log_history) for k in ("time/generation", "time/scoring", "time/training")}
print(f"trained {train_result.global_step} steps in {train_result.metrics['train_runtime']:.0f} s: " +
      ", ".join(f"{k.split('/')[1]} {v:.0f} s" for k, v in times.items()))
if trainer.args.fp16:  # fp16 trains under a loss scaler, which skips a step whose gradients overflow
    print(f"fp16: {dashboard.skipped_steps} of {train_result.global_step} optimizer steps skipped for inf/NaN gradients (GRPO)")

# %% [markdown]
# ## 7. Held-back problems
#
# Greedy answers to problems the model never saw, with both rewards. The tiny default learns the
# format (its greedy answers are well formed) but not the arithmetic, and its answers tend to repeat
# one line whatever the question: the reward asked for the format, and the format is what it got. A
# real model, with a correctness reward it can reach, learns both.

# %%
from notebookkit import FastLanguageModel
from notebookkit.train import generate_reply

FastLanguageModel.for_inference(model)
for row in heldout_ds:
    reply = generate_reply(model, tokenizer, row["prompt"], max_new_tokens=MAX_COMPLETION_LENGTH)
    done = [[{"role": "assistant", "content": reply}]]
    print(f"{row['question']!r} -> {reply!r} | format {format_reward(done)[0]} | "
          f"correct {correctness_reward(done, answer=[row['answer']])[0]} (answer {row['answer']})")
model = FastLanguageModel.for_training(model)

# %% [markdown]
# ## 8. Save the adapter
#
# Only the LoRA matrices are saved (a few MB for a real model); the base model is referenced by name.
# `FastLanguageModel.from_pretrained("<this folder>")` loads base + adapter again.

# %%
adapter_dir = f"{OUTPUT_DIR}/lora_adapter"
model.save_pretrained(adapter_dir)
tokenizer.save_pretrained(adapter_dir)
print("saved:", sorted(p.name for p in __import__("pathlib").Path(adapter_dir).iterdir()))

# %% [markdown]
# ## Last: did the reward rise? (checked automatically)
#
# CI runs this notebook on the tiny default and this cell fails the run unless GRPO raised the mean
# reward of the sampled completions: the mean over the last `FIRST_LAST` steps must exceed the mean over
# the first `FIRST_LAST` by `MIN_REWARD_RISE`. With the learning rate at 0 the policy stays the primed
# model, the reward only fluctuates, and this cell fails.

# %%
from notebookkit.notebook_cells import first_and_last

first, last = first_and_last(trainer, "reward", n=FIRST_LAST, rows_with=("loss",))
print(f"mean reward, first {FIRST_LAST} steps {first:.3f} -> last {FIRST_LAST} steps {last:.3f} "
      f"(rise {last - first:+.3f}; required {MIN_REWARD_RISE})")
for name in ("format_reward", "correctness_reward"):
    name_first, name_last = first_and_last(trainer, f"rewards/{name}/mean", n=FIRST_LAST)
    print(f"  {name}: {name_first:.3f} -> {name_last:.3f}")
assert last - first >= MIN_REWARD_RISE, f"the mean reward rose only {last - first:+.3f} (< {MIN_REWARD_RISE})"
print("learning signal: OK")
