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
# # Export a fine-tune: LoRA adapter, merged 16-bit model, GGUF for llama.cpp / Ollama
#
# A fine-tune is useful once it leaves the notebook in the form your server reads. This notebook
# trains one made-up fact into a model (the **canary**: a password no model knows), exports every
# form you pick in the panel below, **reloads each one** and shows one table: form, size on disk,
# largest logit difference against the adapter model on a fixed prompt set, whether greedy answers
# are equal, and whether the canary fact is still there. An export that silently dropped the LoRA
# update, or a GGUF whose chat template no longer reaches the answer, shows up as a missing canary.

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

# %% tags=["parameters"]
MODEL_NAME = None          # None: "notebookkit/tiny-llama" on CPU, GPU_MODEL on a GPU
GPU_MODEL = "Qwen/Qwen3-0.6B"
LOAD_IN_4BIT = None        # None: 4-bit on a GPU, 16/32-bit on CPU
LORA_R = 16
CANARY_STEPS = 200         # at most this many steps to learn the canary fact
EXPORT_FORMS = ["lora", "merged_16bit", "gguf"]   # the panel's starting choice
GGUF_METHODS = ["q8_0"]    # f16, bf16, q8_0, q4_0 (notebookkit); q4_k_m, q5_k_m, q6_k (llama.cpp's quantiser)
OUTPUT_DIR = "outputs/export"
SEED = 3407

# %% [markdown]
# **llama.cpp for GGUF.** Each GGUF file is checked by loading it in llama.cpp, and the K-quants are made by
# its quantiser: both come with `llama-cpp-python`, which Colab and Kaggle do not have. The next cell installs it
# when a GGUF form is chosen (pip compiles llama.cpp: several minutes, once per session); when it cannot, it stops
# and says what to do.

# %%
from notebookkit.export import install_llama_cpp

if "gguf" in EXPORT_FORMS:
    install_llama_cpp()

# %%
from notebookkit.notebook_cells import apply_script_arguments, resolve_parameters

apply_script_arguments(globals())  # run as a script: --config FILE and --NAME VALUE flags (in Jupyter: nothing)
ON_GPU = resolve_parameters(
    globals(),
    gpu=dict(MODEL_NAME=GPU_MODEL, LOAD_IN_4BIT=True),
    cpu=dict(MODEL_NAME="notebookkit/tiny-llama", LOAD_IN_4BIT=False),
)

# %% [markdown]
# ## 1. What to export
#
# Pick the forms (the adapter alone, the merged 16-bit model that plain `transformers` loads, GGUF
# files for llama.cpp / Ollama / LM Studio), the GGUF quantisations (K-quants need
# `llama-cpp-python`), how much of the GPU the merge may fill, the folder, and whether to verify.

# %%
from notebookkit.widgets import ExportPanel

export_panel = ExportPanel(output_dir=OUTPUT_DIR, forms=EXPORT_FORMS, gguf_methods=GGUF_METHODS)
export_panel

# %% [markdown]
# ## 2. Load, add adapters, and train the canary fact
#
# `train_canary` runs AdamW on one chat example (loss on the answer only) until greedy decoding
# answers with the fact. Before training the model does not know it.

# %%
import torch
from notebookkit import FastLanguageModel
from notebookkit.export import DEFAULT_CANARY as canary, train_canary

model, tokenizer = FastLanguageModel.from_pretrained(MODEL_NAME, load_in_4bit=LOAD_IN_4BIT)
model = FastLanguageModel.get_peft_model(model, r=LORA_R, lora_alpha=2 * LORA_R, use_gradient_checkpointing=False)
FastLanguageModel.for_inference(model)
known_before = canary.recalled_by(model, tokenizer)
run = train_canary(model, tokenizer, canary, max_steps=CANARY_STEPS)
print(f"canary known before training: {known_before}; recalled after {run.steps} steps: {canary.recalled_by(model, tokenizer)}")
if model.get_input_embeddings().weight.dtype == torch.float16:  # 16-bit activations can overflow: such steps are skipped
    print(f"fp16: {run.skipped_steps} of {run.steps} optimizer steps skipped for inf/NaN gradients")

# %% [markdown]
# ## 3. Export, reload, compare
#
# Each form is written (the merged model layer by layer, streamed to safetensors shards; GGUF files
# with an Ollama `Modelfile` beside them) and, with verification on, reloaded: the merged folder in
# plain `transformers`, each GGUF in llama.cpp.

# %%
import pandas as pd
from notebookkit.export import export_and_verify

choice = export_panel.value
rows = export_and_verify(model, tokenizer, canary=canary, **choice.kwargs())
table = pd.DataFrame(rows).drop(columns=["path"])
table

# %% [markdown]
# ## 4. Verdict
#
# The canary was unknown before training and every verified export still recalls it, within the
# stated tolerance of the adapter model.

# %%
assert not known_before, "the canary fact was known before training"
for row in rows:
    if "canary" in row:
        assert row["canary"], f"{row['form']} lost the canary fact"
        assert row["within_tolerance"], f"{row['form']} differs from the adapter model beyond its tolerance"
print("every export recalls the canary fact")
