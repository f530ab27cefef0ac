"""Every mark notebookkit leaves on another library's objects, by name, in one place.

notebookkit patches instances, not classes: what it needs to remember about a loaded model (the forward
it replaced, the activation plan it applies, the decode state it built) it keeps in the object's own
``__dict__``, set with ``object.__setattr__`` so that ``nn.Module.__setattr__`` does not register it. Each
attribute name is a constant here with a one-line meaning; every module that sets or reads a mark
imports its name from here, so a newcomer finds them all and a rename cannot miss a reader
(``tests/test_marks.py`` fails on a ``_notebookkit_*`` string spelled anywhere else).

Who owns the access: the memory model's marks are set and read through
:mod:`notebookkit.memory.model_setup` (memory/ sits below models/, so the reading layer owns them);
the others belong to the one module named on their line. Imports nothing.
"""

from __future__ import annotations

# ---- read by the memory model (accessors in notebookkit.memory.model_setup) --------------------------
#: causal LM: the per-layer modes (keep / recompute / offload) of the activation plan it runs, or "none"
ACTIVATION_PLAN = "_notebookkit_checkpointing"
#: causal LM: ``(tokens, max_memory)`` an ``"auto"`` activation plan was sized for
AUTO_PLAN_SIZE = "_notebookkit_auto_plan_size"
#: frozen base linear: its forward runs the FP8 matmul
FP8_FORWARD = "_notebookkit_fp8_forward"
#: causal LM: its forward computes the training loss with the fused linear cross-entropy
FUSED_LM_HEAD = "_notebookkit_fused_lm_head"
#: input embedding: the address of its table in pinned host memory (``offload_embedding=True``)
HOST_EMBEDDING = "_notebookkit_host_embedding"
#: causal LM: the format its frozen decoder projections are held in (a :mod:`notebookkit.base_formats` name)
BASE_FORMAT = "_notebookkit_base_format"
#: a mixture of experts' experts module (Hugging Face's, under PEFT's wrappers): the bytes of one chunk of its NF4
#: experts decoded at a time, as the ``"auto"`` activation plan the model runs was sized for
EXPERT_CHUNK_BUDGET = "_notebookkit_expert_chunk_budget"

# ---- instance patching (base_layers/rebinding.py, models/patching/patcher.py) ------------------------
#: patched module: ``(slot, original forward)``, what ``restore`` puts back
ORIGINAL_FORWARD = "_notebookkit_original_forward"
#: patched module: the bound forward notebookkit put in its place
PATCHED_FORWARD = "_notebookkit_patched_forward"
#: patched module: what kind of patch it carries (``"rms_norm"``, ``"mlp"``, ...)
PATCH_TAG = "_notebookkit_patch"

# ---- the fused LM head (models/patching/patch_lm_head.py) ---------------------------------------------
#: backbone: a weak reference to the causal LM whose patched head owns it
LM_HEAD_OWNER = "_notebookkit_owner"
#: backbone: every attention layer is patched, so a plain causal mask can be skipped
ALL_ATTENTION_PATCHED = "_notebookkit_all_attention_patched"
#: causal LM: the warning about inputs longer than ``max_seq_length`` was given once
WARNED_LENGTH = "_notebookkit_warned_length"
#: causal LM: its patched head adds the routers' load-balancing loss (a mixture of experts)
ROUTER_LOSS_HEAD = "_notebookkit_router_loss_head"

# ---- checkpointing, LoRA and precision (models/patching/, base_layers/) -----------------------------
#: base model: the Trainer's ``gradient_checkpointing_enable`` re-applies notebookkit's plan
CHECKPOINTING_GUARD = "_notebookkit_gc_guard"
#: first module of a LoRA group: the adapter views kept for the current pass (models/patching/lora_fast_path.py)
LORA_VIEWS = "_notebookkit_views"
#: LoRA layer on a 4-bit base: PEFT's ``merge`` / ``unmerge`` check the CPU decode first (base_layers/linear4bit.py)
MERGE_GUARD = "_notebookkit_merge_guard"
#: LoRA layer on a 4-bit base: a weak reference to the model whose 4-bit bases that check decodes
MERGE_ROOT = "_notebookkit_merge_root"
#: module with an fp32 master weight under fp16: the hooks that cast its inputs and outputs (models/patching/master_weights.py)
FP32_MASTER_HOOKS = "_notebookkit_fp32_master_hooks"

# ---- generation (models/generation/state.py) --------------------------------------------------------
#: causal LM: its decode state (static KV cache, captured decode step)
GENERATION_STATE = "_notebookkit_generation"
#: on a causal LM: how generate() prepares its prompt (set by the vision loader: image features)
PREPARE_PROMPT = "_notebookkit_prepare_prompt"

# ---- training (train/) ------------------------------------------------------------------------------
#: trainer: the reasons already warned about for running TRL's own loss (train/trainer_glue.py)
LOSS_FALLBACKS = "_notebookkit_fallbacks"
#: reward function: already wrapped by ``checked_reward`` (train/rewards.py)
CHECKED_REWARD = "__notebookkit_checked__"
