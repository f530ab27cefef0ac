#!/usr/bin/env python
"""Chat SFT with LoRA, as a script: the logic of ``notebooks/sft/chat_sft.ipynb``, launchable on one
process or data-parallel on several.

One process (one GPU, or the CPU)::

    python scripts/train_sft.py --max_steps 20
    python scripts/train_sft.py --config my_run.yaml --learning_rate 1e-4   # flags override the file

Data parallel, N processes on one machine (each holds a copy of the model on its own GPU; on a CPU
machine they talk over gloo)::

    torchrun --nproc_per_node 2 scripts/train_sft.py --config my_run.yaml
    accelerate launch --num_processes 2 scripts/train_sft.py --config my_run.yaml   # add --cpu without GPUs

A model too large for one card, spread layer by layer over the visible GPUs (one process)::

    python scripts/train_sft.py --model_name meta-llama/Llama-3.1-8B-Instruct --device_map balanced

The settings have the names of the notebook's panels (``model_name``, ``max_seq_length``,
``load_in_4bit``, ``r``, ``lora_alpha``, ``learning_rate``, ``max_steps``,
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``seed``, ``output_dir``, ...); a
config file (JSON, or YAML when PyYAML is installed) may also use the notebook's parameter-cell names
(``MODEL_NAME``, ``LORA_R``, ``BATCH_SIZE``, ``GRAD_ACCUM``, ...). ``python scripts/train_sft.py --help``
lists them all. ``None`` means "choose for this machine", as in the notebook.

The global batch of one optimizer step is ``per_device_train_batch_size * gradient_accumulation_steps
* processes`` sequences; 2 processes x 2 train like 1 process x 4 (the test
``tests/distributed/test_ddp_equivalence.py`` checks the LoRA weights agree within the rounding noise
of one process splitting the same batch into accumulation steps).

Outputs (rank 0 only): ``<output_dir>/lora_adapter`` (adapter + tokenizer) and
``<output_dir>/train_summary.json`` (settings, world size, losses, tokens per second).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

# Run from a clone without installing: make the repository's package importable.
_REPO = Path(__file__).resolve().parents[1]
if (_REPO / "notebookkit" / "__init__.py").is_file() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# Settings: name -> (default, type, help). ``None`` defaults are resolved per machine in resolve().
PARAMS: dict[str, tuple[Any, str, str]] = {
    "model_name": (None, "str", 'model: tiny name, local folder or Hub id (None: "notebookkit/tiny-llama" on CPU, gpu_model on GPU)'),
    "gpu_model": ("Qwen/Qwen3-0.6B", "str", "model used on a GPU when model_name is None"),
    "max_seq_length": (None, "int", "longest sequence in tokens (None: 2048 on GPU, 512 on CPU)"),
    "load_in_4bit": (None, "bool", "NF4 QLoRA (None: on GPU yes, on CPU no)"),
    "dtype": (None, "str", "bfloat16 / float16 / float32 (None: best for the device)"),
    "device_map": (None, "str", 'None: this process\'s device; "balanced": layers over all GPUs (one process only)'),
    "chat_template": (None, "str", 'chat format, e.g. "llama-3", "chatml" (None: guessed)'),
    "r": (16, "int", "LoRA rank"),
    "lora_alpha": (None, "int", "LoRA alpha (None: equal to r)"),
    "lora_dropout": (0.0, "float", "LoRA dropout (0 keeps the fused kernels)"),
    "use_gradient_checkpointing": ("auto", "str", 'False / True / "offload" / "auto"'),
    "fp8_base_matmul": (False, "bool", "FP8 forward of the frozen base matmuls (GPUs with FP8 tensor cores: L4, RTX 4090, H100)"),
    "dataset": ("chat_sharegpt", "str", "bundled dataset kind, or a JSONL file with conversations/messages rows"),
    "dataset_rows": (None, "int", "train on the first N rows only (None: all)"),
    "n_eval": (16, "int", "conversations held back from training (evaluated at the end; 0: none)"),
    "responses_only": (True, "bool", "loss on assistant turns only"),
    "max_length": (None, "int", "truncate training rows to this many tokens (None: from the length profile)"),
    "learning_rate": (None, "float", "peak learning rate (None: 2e-4 on GPU, 2e-3 on CPU)"),
    "max_steps": (None, "int", "optimizer steps (None: 60 on GPU, 40 on CPU)"),
    "per_device_train_batch_size": (4, "int", "sequences per process per micro-batch"),
    "gradient_accumulation_steps": (1, "int", "micro-batches per optimizer step"),
    "warmup_steps": (2, "int", "linear warm-up steps"),
    "weight_decay": (0.01, "float", "AdamW weight decay"),
    "lr_scheduler_type": ("linear", "str", "learning-rate schedule"),
    "optim": (None, "str", "optimizer (None: adamw_8bit on GPU, adamw_torch on CPU)"),
    "shuffle": (True, "bool", "shuffle rows (seeded: every process draws the same permutation)"),
    "packing": (False, "bool", "pack several conversations per row"),
    "logging_steps": (1, "int", "log every N steps"),
    "seed": (3407, "int", "seed for LoRA init, data order and dropout"),
    "output_dir": ("outputs/chat_sft", "str", "where the adapter and train_summary.json go"),
    "save_adapter": (True, "bool", "save the LoRA adapter at the end"),
}

# Names of the notebook's parameters cell -> script settings.
NOTEBOOK_ALIASES = {
    "lora_r": "r",
    "batch_size": "per_device_train_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "n_eval": "n_eval",
}
# Notebook parameters that have no meaning in the script (calibration, plots, assertions).
NOTEBOOK_ONLY = {"calibration_steps", "n_exact", "min_loss_drop", "cpu_steps", "cpu_learning_rate"}


def _parse_value(raw: Any, kind: str, name: str) -> Any:
    if raw is None:
        return None
    if isinstance(raw, str) and raw.strip().lower() in ("none", "null", ""):
        return None
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except (TypeError, ValueError):
        raise SystemExit(f"setting {name}={raw!r} is not a valid {kind}; fix it in the config file or flag.") from None
    if name == "use_gradient_checkpointing" and isinstance(raw, str) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def _read_config_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise SystemExit(f"{path} is YAML but PyYAML is not installed: `pip install pyyaml`, or use JSON.") from None
        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"{path} must hold one mapping of setting -> value.")
    out: dict[str, Any] = {}
    cpu_extras = {}
    for key, value in data.items():
        name = str(key).lower()
        name = NOTEBOOK_ALIASES.get(name, name)
        if name in ("cpu_steps", "cpu_learning_rate"):
            cpu_extras[name] = value
            continue
        if name in NOTEBOOK_ONLY:
            continue
        if name not in PARAMS:
            known = ", ".join(PARAMS)
            raise SystemExit(f"{path}: unknown setting {key!r}. Known settings: {known}.")
        out[name] = value
    out["_cpu_extras"] = cpu_extras
    return out


def parse_config(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Settings from ``--config FILE`` and ``--<name> VALUE`` flags (flags win), defaults for the rest."""
    parser = argparse.ArgumentParser(
        description="Chat SFT with LoRA (the chat SFT notebook as a script). Launch with python, torchrun or accelerate.",
    )
    parser.add_argument("--config", help="JSON/YAML file of settings (names as below, or the notebook's parameter names)")
    for name, (default, kind, help_text) in PARAMS.items():
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, help=f"{help_text} [default: {default}]")
    args = vars(parser.parse_args(argv))
    config: dict[str, Any] = {name: spec[0] for name, spec in PARAMS.items()}
    extras: dict[str, Any] = {}
    if args.get("config"):
        from_file = _read_config_file(args.pop("config"))
        extras = from_file.pop("_cpu_extras")
        config.update(from_file)
    args.pop("config", None)
    config.update(args)
    config = {name: _parse_value(value, PARAMS[name][1], name) for name, value in config.items()}
    config["_cpu_extras"] = extras
    return config


def resolve(config: dict[str, Any]) -> dict[str, Any]:
    """Fill the ``None`` settings the way the notebook does for this machine."""
    import torch

    cfg = dict(config)
    extras = cfg.pop("_cpu_extras", {}) or {}
    on_gpu = torch.cuda.is_available()
    cfg["model_name"] = cfg["model_name"] or (cfg["gpu_model"] if on_gpu else "notebookkit/tiny-llama")
    cfg["load_in_4bit"] = on_gpu if cfg["load_in_4bit"] is None else cfg["load_in_4bit"]
    cfg["max_seq_length"] = cfg["max_seq_length"] or (2048 if on_gpu else 512)
    cfg["max_steps"] = cfg["max_steps"] or (60 if on_gpu else int(extras.get("cpu_steps", 40)))
    cfg["learning_rate"] = cfg["learning_rate"] or (2e-4 if on_gpu else float(extras.get("cpu_learning_rate", 2e-3)))
    cfg["lora_alpha"] = cfg["lora_alpha"] or cfg["r"]
    return cfg


def load_data(cfg: dict[str, Any]):
    """(train, held-out) conversations with a ``messages`` column, split as in the notebook."""
    from notebookkit.data import standardize_sharegpt
    from notebookkit.train import split_heldout

    source = cfg["dataset"]
    if source.endswith((".jsonl", ".json")) or os.path.sep in source:
        if not Path(source).is_file():
            raise SystemExit(f"dataset={source!r} is neither a bundled dataset kind nor an existing JSONL file.")
        from datasets import load_dataset

        raw = load_dataset("json", data_files=str(source), split="train")
    else:
        from notebookkit.data.bundled import load_bundled

        raw = load_bundled(source)
    if "messages" not in raw.column_names:
        raw = standardize_sharegpt(raw, output_column="messages")
    dataset = raw.select_columns(["messages"])
    if cfg["dataset_rows"]:
        dataset = dataset.select(range(min(cfg["dataset_rows"], len(dataset))))
    if cfg["n_eval"] and cfg["n_eval"] > 0:
        return split_heldout(dataset, n_eval=cfg["n_eval"], seed=cfg["seed"])
    return dataset, None


def build(config: dict[str, Any], callbacks: Optional[list] = None):
    """Load model and data and build the ``SFTTrainer`` (every process runs this).

    Returns ``(trainer, model, tokenizer, cfg)`` with ``cfg`` the resolved settings.
    """
    from notebookkit import FastLanguageModel
    from notebookkit.data import get_chat_template, guess_chat_template
    from notebookkit.train import make_sft_trainer, sft_config
    from notebookkit.train.distributed import ddp_training_args, dist_info, local_device_map, seed_everything

    info = dist_info()
    cfg = resolve(config)
    seed_everything(cfg["seed"])
    device_map = local_device_map(cfg["device_map"], info)
    quiet = not info.is_main

    model, tokenizer = FastLanguageModel.from_pretrained(
        cfg["model_name"],
        max_seq_length=cfg["max_seq_length"],
        dtype=cfg["dtype"],
        load_in_4bit=cfg["load_in_4bit"],
        device_map=device_map,
        show_banner=not quiet,
    )
    template = cfg["chat_template"] or guess_chat_template(tokenizer, cfg["model_name"])
    tokenizer = get_chat_template(tokenizer, template, model=model)
    cfg["chat_template"] = template
    peft_extra: dict[str, Any] = {}
    if "planning_batch_size" in inspect.signature(FastLanguageModel.get_peft_model).parameters:
        peft_extra["planning_batch_size"] = cfg["per_device_train_batch_size"]
    if cfg["fp8_base_matmul"]:
        peft_extra["fp8_base_matmul"] = True
    model = FastLanguageModel.get_peft_model(
        model,
        r=cfg["r"],
        lora_alpha=cfg["lora_alpha"],
        lora_dropout=cfg["lora_dropout"],
        use_gradient_checkpointing=cfg["use_gradient_checkpointing"],
        random_state=cfg["seed"],
        max_seq_length=cfg["max_seq_length"],
        show_banner=not quiet,
        **peft_extra,
    )

    extra: dict[str, Any] = {}
    if info.is_distributed:
        extra.update(ddp_training_args())
    if not cfg["shuffle"]:
        extra["train_sampling_strategy"] = "sequential"
    # notebookkit already chose the checkpointing mode in get_peft_model; keep the Trainer out of it.
    extra["gradient_checkpointing"] = False
    args = sft_config(
        cfg["output_dir"],
        model=model,
        max_steps=cfg["max_steps"],
        learning_rate=cfg["learning_rate"],
        per_device_train_batch_size=cfg["per_device_train_batch_size"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
        warmup_steps=cfg["warmup_steps"],
        weight_decay=cfg["weight_decay"],
        lr_scheduler_type=cfg["lr_scheduler_type"],
        optim=cfg["optim"],
        seed=cfg["seed"],
        max_length=cfg["max_length"] or cfg["max_seq_length"],
        packing=cfg["packing"],
        logging_steps=cfg["logging_steps"],
        **extra,
    )
    # Every process reads and tokenises the data; the main one first, so the others reuse its cache.
    with args.main_process_first(desc="dataset"):
        train_ds, eval_ds = load_data(cfg)
        if cfg["max_length"] is None:
            from notebookkit.data import profile_lengths

            suggested = profile_lengths(train_ds, tokenizer).suggested_max_seq_length
            cfg["max_length"] = min(cfg["max_seq_length"], int(suggested))
            args.max_length = cfg["max_length"]
        trainer = make_sft_trainer(
            model, tokenizer, train_ds, eval_ds, args=args, callbacks=callbacks, responses_only=cfg["responses_only"]
        )
    cfg["world_size"] = info.world_size
    cfg["global_batch"] = cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"] * info.world_size
    return trainer, model, tokenizer, cfg


def _peak_memory_per_process() -> Optional[list[float]]:
    """Peak GPU memory allocated by each process (GiB), gathered to every rank; None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    mine = torch.cuda.max_memory_allocated() / 2**30
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return [float(x) for x in gathered]
    return [mine]


def run(config: dict[str, Any], callbacks: Optional[list] = None) -> dict[str, Any]:
    """Build, train, evaluate, save; returns the summary written to ``train_summary.json``."""
    from notebookkit.train.distributed import dist_info, main_print

    info = dist_info()
    trainer, model, tokenizer, cfg = build(config, callbacks)
    main_print(
        f"training {cfg['model_name']} on {info.world_size} process(es) "
        f"[{trainer.args.device.type}{', DDP ' + trainer.args.ddp_backend if info.is_distributed else ''}]: "
        f"global batch {cfg['global_batch']} = {cfg['per_device_train_batch_size']} per process x "
        f"{cfg['gradient_accumulation_steps']} accumulation x {info.world_size} processes, {cfg['max_steps']} steps",
        info=info,
    )
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    metrics = dict(result.metrics)
    eval_metrics = trainer.evaluate() if trainer.eval_dataset is not None else {}

    peaks = _peak_memory_per_process()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    tokens = next((h["num_tokens"] for h in reversed(history) if "num_tokens" in h), None)
    summary = {
        "settings": {k: v for k, v in cfg.items() if not k.startswith("_")},
        "world_size": info.world_size,
        "global_batch": cfg["global_batch"],
        "steps": result.global_step,
        "train_seconds": seconds,
        "train_tokens": tokens,
        "tokens_per_second": (tokens / seconds) if tokens else None,
        "losses": losses,
        "eval_loss": eval_metrics.get("eval_loss"),
        "peak_memory_gib_per_process": peaks,
        "metrics": metrics,
    }
    out = Path(cfg["output_dir"])
    if cfg["save_adapter"]:
        trainer.save_model(str(out / "lora_adapter"))  # writes on the main process only
        if info.is_main:
            tokenizer.save_pretrained(str(out / "lora_adapter"))
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        first = f"{losses[0]:.4f}" if losses else "?"
        last = f"{losses[-1]:.4f}" if losses else "?"
        main_print(
            f"done: {result.global_step} steps in {seconds:.1f} s, loss {first} -> {last}"
            + (f", held-out loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "")
            + (f", {summary['tokens_per_second']:.0f} tokens/s" if summary["tokens_per_second"] else "")
            + (f", peak GPU memory {max(peaks):.2f} GiB per process" if peaks else "")
            + f"; saved to {out}",
            info=info,
        )
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(parse_config(argv))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
