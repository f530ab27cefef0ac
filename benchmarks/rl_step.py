"""One GRPO step and one DPO step per system, side by side, each row in its own process.

    python benchmarks/rl_step.py --out benchmarks/results                          # GPU: every row
    python benchmarks/rl_step.py --out benchmarks/results --unsloth-site .site-unsloth
    python benchmarks/rl_step.py --tiny --out /tmp/rl-step                         # CPU: checks this script
    python benchmarks/rl_step.py --prepare                                         # build the checkpoints only
    python benchmarks/rl_step.py --tasks grpo --systems notebookkit-lean,unsloth --repeats 3 --budget-s 480 \
        --profile "$OUT/prof" --unsloth-site .site-unsloth      # rounds inside one device call, training halves profiled
    python benchmarks/rl_step.py --tasks grpo --systems notebookkit-lean --profile "$OUT/prof" --memory-history
                                 # and one more step: where the blocks alive at the training half's peak come from

Rows (the issue's configurations):

* ``grpo``: Llama-3.2-1B shape, random bf16 weights, 2 prompts x 8 generations of 512 new tokens
  (``min_new_tokens`` forces the full length, so every system generates the same work), beta = 0
  (TRL's default: no reference forward). Reported: the step time, the part spent in ``model.generate``
  (timed around the model's own ``generate``, the call TRL makes without vLLM), the rest of the step
  (scoring, forward, backward, optimizer), and the peak allocated memory of the step.
* ``dpo``: Llama-3.1-8B shape, NF4 base, 2 preference pairs of 1024 tokens (prompt 256 + answer 767 + EOS):
  the step time and its peak memory.

Systems: ``notebookkit`` (FastLanguageModel + FastGRPOTrainer / FastDPOTrainer, the planner's
``use_gradient_checkpointing="auto"``, which on a large card keeps every activation), ``notebookkit-offload``
(the same with ``"offload"``: layer inputs in pinned host memory, as Unsloth's mode), ``notebookkit-lean``
(``"offload"`` and ``offload_embedding=True``: the input embedding table in host memory too, where it is
not tied to the LM head), ``unsloth-lean`` (Unsloth with its ``offload_embedding=True``), ``trl`` (transformers
+ PEFT + TRL's own trainers, as TRL's docs run them: ``prepare_model_for_kbit_training`` for NF4,
TRL's default gradient checkpointing) and ``unsloth`` (its FastLanguageModel with ``fast_inference=False``
and the TRL trainers it patches on import; Unsloth needs TRL 1.15: pass ``--unsloth-site`` for the
folder of ``../shared/tools/gpu_site.sh --unsloth``, put before the repository on that row's
``PYTHONPATH``). LoRA r=16, alpha=16 on all seven projections, AdamW, bf16, one warm-up step, then
the timed step. A missing package is reported as "not installed", never dropped.

notebookkit's rows record ``fused_path``: LM-head module forwards outside generation (0: the loss ran on
the chunked log-prob path, never ``[B, T, V]`` logits) and any setting that fell back to TRL's loss.

Writes ``<out>/<date>-<gpu>-rl-step.json`` and ``.md`` after every row (a run cut short keeps its table); the
markdown table is printed last. ``--budget-s`` keeps a run inside a device call's limit: rows that would start after
it are written as skipped (session 42's ``--repeats 2`` call ran past 560 s and lost Unsloth's second round).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from process_rounds import median_rows, rounds, row_timeout, spread_lines  # noqa: E402  (this folder: plain Python)

SYSTEMS = ("notebookkit", "notebookkit-offload", "notebookkit-lean", "trl", "unsloth", "unsloth-lean")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: task -> the issue's configuration on the GPU, and a CPU-sized one for --tiny
TASKS = {
    "grpo": dict(shape="llama-3.2-1b", quant="bf16", prompts=2, generations=8, prompt_len=64, new_tokens=512),
    "dpo": dict(shape="llama-3.1-8b", quant="nf4", pairs=2, prompt_len=256, answer_len=767),  # + EOS: 1024
}
TINY = {
    "grpo": dict(shape="llama-tiny", quant="bf16", prompts=2, generations=4, prompt_len=8, new_tokens=16),
    "dpo": dict(shape="llama-tiny", quant="bf16", pairs=2, prompt_len=8, answer_len=24),
}
NEEDS = {"unsloth": "unsloth", "unsloth-lean": "unsloth"}


# ---------------------------------------------------------------------------------------- data

def word_tokenizer_folder(shape: str) -> str:
    """A folder with the random checkpoint of ``shape`` (``train_step.build_checkpoint``, linked, not copied)
    and a word-level tokenizer over its whole vocabulary (``t0`` ... ``t<V-1>``), so that text and
    token ids map one to one: prompts of N words are N tokens, and any sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from train_step import SHAPES, build_checkpoint
    from transformers import PreTrainedTokenizerFast

    source = build_checkpoint(shape)
    folder = source.rstrip("/") + "-words"
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(source):
        if name.endswith((".safetensors", ".json")) and not name.startswith(("tokenizer", "special_tokens")):
            target = os.path.join(folder, name)
            if not os.path.exists(target):
                os.symlink(os.path.join(source, name), target)
    vocab = SHAPES[shape]["vocab_size"]
    words = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)
    open(os.path.join(folder, "done"), "w").close()
    return folder


def _words(rng, n: int, vocab: int) -> str:
    return " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(n))


def grpo_rows(task: dict, vocab: int, n: int) -> list[dict]:
    import random

    rng = random.Random(0)
    return [{"prompt": _words(rng, task["prompt_len"], vocab)} for _ in range(n)]


def dpo_rows(task: dict, vocab: int, n: int) -> list[dict]:
    import random

    rng = random.Random(0)
    return [{"prompt": _words(rng, task["prompt_len"], vocab), "chosen": " " + _words(rng, task["answer_len"], vocab),
             "rejected": " " + _words(rng, task["answer_len"], vocab)} for _ in range(n)]


def length_reward(completions, **kwargs) -> list[float]:
    """Any reward with spread in a group will do on random weights: the reply's character count."""
    return [float(len(c)) / 100.0 for c in completions]


# ---------------------------------------------------------------------------------------- models

def load_model(system: str, folder: str, quant: str, seq: int, gradient_checkpointing: bool):
    """(model with LoRA, tokenizer) as each system's users build them."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    cuda = torch.cuda.is_available()
    if system.startswith("notebookkit"):
        from notebookkit import FastLanguageModel

        # "auto": the planner fills the free VRAM (on an H200: keeps every activation); "offload": layer inputs
        # in pinned host memory, recomputed in the backward (Unsloth's "unsloth" mode)
        mode = "auto" if system == "notebookkit" else "offload"

        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=seq, load_in_4bit=(quant == "nf4"),
                                                     dtype=torch.bfloat16 if cuda else torch.float32, show_banner=False,
                                                     offload_embedding=system == "notebookkit-lean")
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                                 use_gradient_checkpointing=mode if cuda else False,
                                                 random_state=3407, show_banner=False)
        return model, tokenizer
    if system.startswith("unsloth"):
        from unsloth import FastLanguageModel

        lean = dict(offload_embedding=True) if system == "unsloth-lean" else {}
        model, _ = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=seq, dtype=torch.bfloat16,
                                                     load_in_4bit=(quant == "nf4"), fast_inference=False, **lean)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                                 target_modules=TARGETS, use_gradient_checkpointing="unsloth",
                                                 random_state=3407)
        return model, tokenizer
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = dict(dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa")
    if cuda:
        kwargs["device_map"] = {"": 0}
    if quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if quant == "nf4":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    torch.manual_seed(3407)
    config = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=TARGETS,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config), tokenizer


def trainer_classes(system: str, task: str):
    """(config class, trainer class) the system's users train with."""
    if system.startswith("notebookkit"):
        from trl import DPOConfig, GRPOConfig

        from notebookkit.train import FastDPOTrainer, FastGRPOTrainer

        return (GRPOConfig, FastGRPOTrainer) if task == "grpo" else (DPOConfig, FastDPOTrainer)
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer  # Unsloth's patched classes after its import

    return (GRPOConfig, GRPOTrainer) if task == "grpo" else (DPOConfig, DPOTrainer)


# ---------------------------------------------------------------------------------------- one row

class StepClock:
    """A ``TrainerCallback`` timing each optimizer step (device synchronised) and its peak memory; the
    timed step's peak counter is reset when it begins."""

    def __init__(self, timed_step: int):
        self.timed_step = timed_step
        self.step_s: dict[int, float] = {}
        self.peak_gib: float | None = None
        self._start = 0.0

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class _Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                _sync()
                if state.global_step + 1 == clock.timed_step:
                    _reset_peak()
                clock._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                _sync()
                clock.step_s[state.global_step] = time.perf_counter() - clock._start
                if state.global_step == clock.timed_step:
                    clock.peak_gib = _peak_gib()

        return _Clock()


class StepProfile:
    """A ``TrainerCallback`` running ``torch.profiler`` over the training half of one step (``--profile``): the step
    after the timed one, so the timed step pays none of the profiler's host overhead; for GRPO from the end of its
    generation (:func:`time_generate` calls :meth:`around_generate`) to the step's end: the scoring, forward,
    backward and optimizer, #35's "rest". Its report (``profile_step.trace_report``): the GPU's busy time, its idle
    gaps split into waits for the host and the rest, the host's time in CUDA's API, the kernels. Generation is
    left out: a peer's 512 decode steps are hundreds of thousands of launches, a trace too large to export."""

    def __init__(self, step: int, after_generate: bool):
        self.step, self.after_generate = step, after_generate
        self.active = False  # inside the profiled step
        self.prof = None
        self.wall_ms = 0.0
        self._start = 0.0

    def _begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        _sync()
        self.prof = profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU])
        self.prof.start()
        self._start = time.perf_counter()

    def around_generate(self, starting: bool) -> None:
        """Before a generate call of the profiled step: drop a profile already running (the window starts after
        the step's last generation); after it: start one."""
        if not (self.active and self.after_generate):
            return
        if starting and self.prof is not None:
            self.prof.stop()  # dropped
            self.prof = None
        elif not starting:
            self._begin()

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class _Profile(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == clock.step:
                    clock.active = True
                    if not clock.after_generate:
                        clock._begin()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == clock.step and clock.prof is not None:
                    _sync()
                    clock.wall_ms = (time.perf_counter() - clock._start) * 1e3
                    clock.prof.stop()
                    clock.active = False

        return _Profile()

    def report(self, title: str, facts: list[tuple[str, str]]) -> str:
        """The markdown report of the profiled window (empty when nothing was profiled)."""
        from profile_step import trace_events, trace_report

        if self.prof is None:
            return ""
        return trace_report(title, facts, trace_events(self.prof), self.wall_ms)


class StepMemory(StepProfile):
    """:class:`StepProfile`'s window in a step of its own (``--memory-history``), under the allocator's history
    instead of the profiler (``memory_history.Recording``: every allocation's stack, which costs host time).
    Its report: the window's peak replayed, and where the blocks alive at it were allocated (#35's GRPO rest
    peaked 0.31 GiB over the memory model)."""

    def _begin(self) -> None:
        from memory_history import Recording

        self.prof = Recording()
        self.prof.start()
        self._start = time.perf_counter()

    def report(self, title: str, facts: list[tuple[str, str]]) -> str:
        return "" if self.prof is None else self.prof.report(title, facts)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**30, 3)
    from notebookkit.memory.meters import host_rss

    return round(host_rss() / 2**30, 3)  # CPU check only: the process's resident memory


def watch_fused_path(model, calls: list) -> dict:
    """Count the LM head's module forwards outside ``model.generate`` (``calls`` is :func:`time_generate`'s list,
    whose wrapper flags generation): notebookkit's fused loss calls none (it reads ``lm_head.weight`` in chunks);
    a forward there means ``[B, T, V]`` logits. Returns the live counter dict."""
    seen = {"lm_head_forwards_in_training": 0, "in_generate": False}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def hook(module, args, output):
        if not seen["in_generate"]:
            seen["lm_head_forwards_in_training"] += 1

    base.get_output_embeddings().register_forward_hook(hook)
    return seen


def time_generate(model, flags: dict | None = None, windows: tuple[StepProfile, ...] = (),
                  peaks: list | None = None) -> list[tuple[int, float]]:
    """Wrap ``model.generate`` (the instance's) to record (global call index, seconds) per call, synchronised at
    both ends (``windows``: told before and after each call, :meth:`StepProfile.around_generate`). ``peaks``: each
    call's peak memory in GiB (:func:`_peak_gib`, the counter then reset, so the step's end reads the peak of what
    followed the generation: which half of a GRPO step sets its peak)."""
    calls: list[tuple[int, float]] = []
    generate = model.generate

    def timed(*args, **kwargs):
        for window in windows:
            window.around_generate(starting=True)
        _sync()
        start = time.perf_counter()
        if flags is not None:
            flags["in_generate"] = True
        try:
            out = generate(*args, **kwargs)
        finally:
            if flags is not None:
                flags["in_generate"] = False
        _sync()
        calls.append((len(calls), time.perf_counter() - start))
        if peaks is not None:
            peaks.append(_peak_gib())
            _reset_peak()
        for window in windows:
            window.around_generate(starting=False)
        return out

    model.generate = timed
    return calls


def run_child(system: str, task_name: str, task: dict, out_dir: str, profile: str | None = None,
              repeat: int = 0, memory_history: bool = False) -> dict:
    """One row in this process: a warm-up step, the timed step and, with ``profile`` (a folder), one more step
    under the profiler (:class:`StepProfile`), reported as ``profile-<task>-<system>[-<repeat>].md`` there; with
    ``memory_history`` too, one more under the allocator's history (:class:`StepMemory`), ``memory-...md``."""
    import torch
    from datasets import Dataset
    from train_step import SHAPES, versions

    cuda = torch.cuda.is_available()
    folder = word_tokenizer_folder(task["shape"])
    vocab = SHAPES[task["shape"]]["vocab_size"]
    seq = task["prompt_len"] + (task["new_tokens"] if task_name == "grpo" else task["answer_len"]) + 8
    gradient_checkpointing = cuda
    model, tokenizer = load_model(system, folder, task["quant"], seq, gradient_checkpointing)
    config_class, trainer_class = trainer_classes(system, task_name)
    windows = step_windows(task_name, profile, memory_history)
    steps = 2 + len(windows)
    common = dict(output_dir=os.path.join(out_dir, f"{task_name}-{system}"), max_steps=steps, learning_rate=1e-5,
                  logging_steps=1, report_to="none", save_strategy="no", use_cpu=not cuda, bf16=cuda, fp16=False,
                  optim="adamw_torch", seed=0, dataloader_num_workers=0, disable_tqdm=True,
                  gradient_checkpointing=gradient_checkpointing and system == "trl")
    clock = StepClock(timed_step=2)
    fused = watch_fused_path(model, []) if system.startswith("notebookkit") else None
    if task_name == "grpo":
        batch = task["prompts"] * task["generations"]
        args = config_class(**common, per_device_train_batch_size=batch, num_generations=task["generations"],
                            max_completion_length=task["new_tokens"], temperature=1.0, beta=0.0,
                            generation_kwargs={"min_new_tokens": task["new_tokens"]})
        data = Dataset.from_list(grpo_rows(task, vocab, 2 * task["prompts"]))
        trainer = trainer_class(model=model, reward_funcs=length_reward, args=args, train_dataset=data,
                                processing_class=tokenizer)
        generate_peaks: list = []
        calls = time_generate(model, fused, tuple(windows.values()), generate_peaks)
    else:
        args = config_class(**common, per_device_train_batch_size=task["pairs"], beta=0.1,
                            max_length=task["prompt_len"] + task["answer_len"])
        data = Dataset.from_list(dpo_rows(task, vocab, 2 * task["pairs"]))
        trainer = trainer_class(model=model, ref_model=None, args=args, train_dataset=data, processing_class=tokenizer)
        calls = []
    trainer.add_callback(clock.callback())
    for window in windows.values():
        trainer.add_callback(window.callback())
    trainer.train()
    step_s = clock.step_s.get(2)
    row = dict(status="ok", step_s=round(step_s, 3), warmup_step_s=round(clock.step_s.get(1, float("nan")), 3),
               peak_gib=clock.peak_gib, losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
               versions=versions(system) | _trl_version(), gpu=torch.cuda.get_device_name(0) if cuda else "cpu")
    if fused is not None:  # notebookkit's loss on the fused path: no LM-head forward, no TRL fallback
        row["fused_path"] = dict(lm_head_forwards_in_training=fused["lm_head_forwards_in_training"],
                                 fallbacks=sorted(trainer.__dict__.get("_notebookkit_fallbacks", ())))
        row["predicted_gib"] = predicted_peak_gib(model, trainer, task_name, task)
    if task_name == "grpo":
        per_step = len(calls) // steps
        timed = [s for _, s in calls[per_step:2 * per_step]]  # the timed (second) step's generation
        generate_s = sum(timed) if calls else None
        if calls:
            row |= split_peak(row["peak_gib"], generate_peaks[per_step:2 * per_step])
        row |= dict(generate_s=None if generate_s is None else round(generate_s, 3),
                    rest_s=None if generate_s is None else round(step_s - generate_s, 3),
                    generate_calls=len(calls),
                    completion_tokens=task["prompts"] * task["generations"] * task["new_tokens"])
        logged = [h for h in trainer.state.log_history if "time/generation" in h]
        if logged:  # notebookkit's own split of the step
            row["logged_times"] = {k: round(logged[-1][k], 3) for k in ("time/generation", "time/scoring", "time/training")}
    facts = [("device", row["gpu"]), ("task", json.dumps(task)), ("timed step s (unprofiled)", f"{step_s:.3f}")]
    if row.get("rest_s") is not None:
        facts.append(("its training half s (unprofiled: the step less its generation)", f"{row['rest_s']:.3f}"))
    if row.get("predicted_gib") is not None:
        facts.append(("the memory model's peak GiB / the timed step's", f"{row['predicted_gib']} / {row['peak_gib']}"))
    for kind, window in windows.items():
        name = f"{kind}-{task_name}-{system}{f'-{repeat}' if repeat else ''}.md"
        what = {"profile": "profiled", "memory": "under the allocator's history"}[kind]
        os.makedirs(profile, exist_ok=True)
        with open(os.path.join(profile, name), "w") as fh:
            fh.write(window.report(f"{task_name.upper()} step of {system}: the training half, {what} (step "
                                   f"{window.step}, after the timed one; GRPO's from the end of its generation)", facts))
        row[kind] = name
    return row


def step_windows(task_name: str, profile: str | None, memory_history: bool) -> dict[str, StepProfile]:
    """The extra steps after the timed one (step 2), each a window of its own: the profiler's (``--profile``) in
    step 3, the allocator's history (``--memory-history``, which needs ``--profile``'s folder) in the next."""
    windows: dict[str, StepProfile] = {}
    after_generate = task_name == "grpo"
    if profile:
        windows["profile"] = StepProfile(step=3, after_generate=after_generate)
        if memory_history:
            windows["memory"] = StepMemory(step=4, after_generate=after_generate)
    return windows


def predicted_peak_gib(model, trainer, task_name: str, task: dict) -> float:
    """The memory model's peak for this row (``estimate_for_model``: what the model panel and the planner
    compute), read off the trained model and the trainer's settings; compare with ``peak_gib``."""
    from notebookkit.memory.estimate import estimate_for_model

    if task_name == "grpo":
        rows, new = task["prompts"] * task["generations"], task["new_tokens"]
        seq = task["prompt_len"] + new
        extra = dict(method="grpo", completion_len=new,
                     generation=dict(batch_size=rows, max_len=seq, prompt_len=task["prompt_len"],
                                     keep_cache=trainer.keep_generation_cache))
    else:
        rows, seq, extra = task["pairs"], task["prompt_len"] + task["answer_len"], dict(method="dpo")  # max_length
    estimate = estimate_for_model(model, batch_size=rows, seq_len=seq, cuda_context_bytes=0, **extra)
    return round(estimate.peak_allocated / 2**30, 3)


def _trl_version() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"trl": version("trl")}
    except PackageNotFoundError:
        return {}


# ---------------------------------------------------------------------------------------- the table

def run_row(system: str, task_name: str, tiny: bool, out_dir: str, timeout: int, unsloth_site: str | None,
            child_args: tuple[str, ...] = ()) -> dict:
    """One (task, system) row in a process of its own (``child_args``: more of the child's options)."""
    task = (TINY if tiny else TASKS)[task_name]
    row = dict(task=task_name, system=system, **task)
    env = dict(os.environ)
    path = [ROOT, HERE]
    if system.startswith("unsloth"):
        if unsloth_site:
            path.insert(0, os.path.abspath(unsloth_site))
        elif importlib.util.find_spec("unsloth") is None:
            return row | dict(status="not installed (pass --unsloth-site, see ../shared/tools/gpu_site.sh --unsloth)")
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--system", system, "--task", task_name,
           "--out", out_dir] + (["--tiny"] if tiny else []) + list(child_args)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return row | dict(status=f"timed out after {timeout}s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return row | json.loads(line[7:])
    from run import failure_reason

    text = proc.stderr or proc.stdout
    oom = "OutOfMemory" in text or "out of memory" in text
    return row | dict(status="out of memory" if oom else "failed: " + failure_reason(text))


def _cell(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def split_peak(rest_peak_gib: float | None, generate_peaks_gib: list) -> dict:
    """A GRPO step's peak from its parts: its generate calls' peaks and the peak read at the step's end (what
    followed the last generation, :func:`time_generate` having reset the counter), whichever is higher."""
    generation = max(generate_peaks_gib)
    return dict(generate_peak_gib=generation, rest_peak_gib=rest_peak_gib, peak_gib=max(generation, rest_peak_gib))


def _peak_cell(row: dict) -> str:
    """A GRPO row's peak, with its generation's and the rest's where the row measured them apart."""
    split = row.get("generate_peak_gib"), row.get("rest_peak_gib")
    return _cell(row.get("peak_gib")) + (f" ({split[0]:.2f} / {split[1]:.2f})" if None not in split else "")


def markdown(rows: list[dict]) -> str:
    """The GRPO and DPO tables (a row a system: its median process by step time where ``--repeats`` ran it more than
    once, :mod:`process_rounds`), each followed by its processes' times and round-by-round ratios to Unsloth."""
    ok = [r for r in rows if r.get("status") == "ok"]
    gpu = ok[0]["gpu"] if ok else "?"
    lines = [f"# RL step benchmark, {gpu}, {dt.date.today()}", "",
             "One process per row; LoRA r=16 alpha=16 on all 7 projections, AdamW, bf16, one warm-up step then the "
             "timed step; peak = `torch.cuda.max_memory_allocated` over the timed step (host RSS on CPU; GRPO's in brackets: "
             "its generation's / the rest's). GRPO: "
             "generation = the model's `generate` call(s) of the step, rest = scoring + forward + backward + "
             "optimizer. Versions per row in the JSON.", ""]
    for task in ("grpo", "dpo"):
        runs = [r for r in rows if r["task"] == task]
        if not runs:
            continue
        task_rows = median_rows(runs, "step_s")
        t = task_rows[0]
        if task == "grpo":
            lines += [f"## GRPO: {t['shape']} {t['quant']}, {t['prompts']} prompts x {t['generations']} generations of "
                      f"{t['new_tokens']} tokens", "",
                      "| system | step s | generation s | rest s | peak GiB (generation / rest) | predicted GiB | "
                      "x unsloth speed | status |",
                      "|---|---|---|---|---|---|---|---|"]
        else:
            lines += [f"## DPO: {t['shape']} {t['quant']}, {t['pairs']} pairs x {t['prompt_len'] + t['answer_len']} tokens",
                      "", "| system | step s | peak GiB | predicted GiB | peak / trl | x unsloth speed | status |",
                      "|---|---|---|---|---|---|---|"]
        by = {r["system"]: r for r in task_rows if r.get("status") == "ok"}
        for r in task_rows:
            ok_row = r.get("status") == "ok"
            speed = (f"{by['unsloth']['step_s'] / r['step_s']:.2f}" if ok_row and "unsloth" in by else "–")
            if task == "grpo":
                lines.append(f"| {r['system']} | {_cell(r.get('step_s'))} | {_cell(r.get('generate_s'))} | "
                             f"{_cell(r.get('rest_s'))} | {_peak_cell(r)} | {_cell(r.get('predicted_gib'))} | "
                             f"{speed} | {r['status']} |")
            else:
                ratio = (f"{r['peak_gib'] / by['trl']['peak_gib']:.2f}" if ok_row and "trl" in by and r.get("peak_gib")
                         else "–")
                lines.append(f"| {r['system']} | {_cell(r.get('step_s'))} | {_cell(r.get('peak_gib'))} | "
                             f"{_cell(r.get('predicted_gib'))} | {ratio} | {speed} | {r['status']} |")
        lines += spread_lines(runs, "step_s", "unsloth", "s", ".2f") + [""]  # its leading blank line ends the table
    lines.append("Targets (issue 22): GRPO at least 2x Unsloth's step speed at no more than its peak; DPO at most half "
                 "the plain TRL peak and at least 1.3x Unsloth's speed.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--tasks", default="grpo,dpo")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized rows on a 2-layer Llama (checks the script)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per row")
    ap.add_argument("--budget-s", type=int, default=0,
                    help="seconds for the whole run (under a device call's limit): rows that would start after it "
                         "are written as skipped")
    ap.add_argument("--unsloth-site", default=None, help="folder with Unsloth and TRL 1.15 for the unsloth rows")
    ap.add_argument("--tag", default="", help="added to the result file names (runs split over several calls)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every system this many times, a process each, in rounds (benchmarks/process_rounds.py)")
    ap.add_argument("--prepare", action="store_true", help="only build the random checkpoints (one call, before the rows)")
    ap.add_argument("--profile", default=None,
                    help="folder: one more step a row, its training half under the profiler (GRPO's after its "
                         "generation), reported there: GPU busy, waits for the host, CUDA API time, kernels")
    ap.add_argument("--memory-history", action="store_true",
                    help="with --profile: one more step a row, its training half under the allocator's history; "
                         "the report there says where the blocks alive at its peak were allocated")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--system", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--task", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_history and not args.profile:
        ap.error("--memory-history writes its report into --profile's folder: add --profile DIR.")
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        if args.system.startswith("unsloth"):
            import unsloth  # noqa: F401  (before transformers and TRL: it patches them on import)
        task = (TINY if args.tiny else TASKS)[args.task]
        print("RESULT " + json.dumps(run_child(args.system, args.task, task, args.out, args.profile, args.repeat,
                                               args.memory_history)), flush=True)
        return
    if args.prepare:
        for name in args.tasks.split(","):
            print("prepared", word_tokenizer_folder((TINY if args.tiny else TASKS)[name]["shape"]))
        return
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --tiny to check the script on a CPU.")
    gpu = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    stem = os.path.join(args.out, f"{dt.date.today()}-{gpu}-rl-step{'-tiny' if args.tiny else ''}"
                                  f"{('-' + args.tag) if args.tag else ''}")
    print(markdown(run_all(args, stem)))


def window_args(args, repeat: int) -> tuple[str, ...]:
    """A row's child options for its extra steps (:func:`step_windows`): none without ``--profile``."""
    if not args.profile:
        return ()
    return ("--profile", args.profile, "--repeat", str(repeat)) + (("--memory-history",) if args.memory_history else ())


def run_all(args, stem: str, run=run_row, clock=time.time) -> list[dict]:
    """Every (task, system) row in rounds, a process each; ``<stem>.json`` and ``.md`` rewritten after every row, so
    a run cut short keeps its table. With ``--budget-s``, a row that would start with less than 30 s of the run's
    budget left is written as skipped, and a row's process gets no more than what is left."""
    deadline = clock() + args.budget_s if args.budget_s else None
    rows: list[dict] = []
    for task in args.tasks.split(","):
        for system, repeat in rounds(args.systems.split(","), args.repeats):
            timeout = row_timeout(args.timeout, deadline, clock())
            if timeout is None:
                row = dict(task=task, system=system, **(TINY if args.tiny else TASKS)[task],
                           status=f"skipped: the run's budget of {args.budget_s} s ran out")
            else:
                row = run(system, task, args.tiny, args.out, int(timeout), args.unsloth_site, window_args(args, repeat))
            rows.append(row | dict(repeat=repeat))
            print(json.dumps(rows[-1]), flush=True)
            with open(stem + ".json", "w") as fh:
                json.dump(rows, fh, indent=1)
            with open(stem + ".md", "w") as fh:
                fh.write(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
