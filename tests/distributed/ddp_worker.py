"""Worker for the data-parallel tests: runs the chat SFT notebook's own cells (its jupytext source,
``notebooks/sft/chat_sft.py``) up to the training cell, for several variants in one launch
(``python ddp_worker.py ...`` or ``torchrun --nproc_per_node 2 ddp_worker.py ...``), then trains the
trainer those cells built and records, per variant and rank, the trained LoRA weights and what DDP did.

Each variant's settings are the notebook's parameters, handed to its cells as the ``--NAME VALUE`` flags
of a script run (``notebookkit.notebook_cells.apply_script_arguments`` reads them), so the code under test
is the code a ``torchrun ... chat_sft.py`` launch runs.

Recorded per variant (``<out>/<variant>.rank<r>.pt``):

* ``lora``: every LoRA parameter after training (float32, CPU); ``lora_init``: the same before the
  first step (the tests measure how far each matrix moved);
* ``losses``: the logged training losses;
* ``allreduce_calls``: gradient all-reduce calls, each tagged with the optimizer step it ran in
  (a DDP communication hook counts them; one per gradient bucket per synchronised backward);
* ``micro_batches``: backward passes run; ``find_unused_parameters``: DDP's setting;
* ``buckets``: distinct gradient buckets DDP reduced.

``skip_allreduce`` makes the communication hook return each rank's own gradient without reducing
it (a data-parallel run that is broken on purpose: the tests' negative control).

``force_offload`` swaps every decoder layer's checkpoint function for notebookkit's offload
checkpoint (``notebookkit.models.patching.checkpointing.offload_checkpoint``). On a CPU the layer input stays
in place, but the backward is the same code as on a GPU: a recompute and a nested
``torch.autograd.backward`` inside the custom Function's backward, which is what must cooperate
with DDP's gradient hooks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "sft" / "chat_sft.py"
TRAIN_TAG = "train"


def notebook_cells_before_training(path: Path = NOTEBOOK) -> list[str]:
    """The code cells of the notebook above the one tagged ``train`` (the cell that calls ``trainer.train()``)."""
    import jupytext

    cells = []
    for cell in jupytext.read(path).cells:
        if cell.cell_type != "code":
            continue
        if TRAIN_TAG in cell.metadata.get("tags", []):
            return cells
        cells.append(cell.source)
    raise RuntimeError(f"{path.name} has no code cell tagged {TRAIN_TAG!r}: the worker cannot tell where training starts")


def build_from_notebook(settings: dict, cells: list[str]) -> dict:
    """Run ``cells`` as a script run of the notebook would, with ``settings`` as ``--NAME VALUE`` flags;
    returns the notebook's namespace (``trainer``, ``model``, ``LAUNCH``, ...)."""
    argv = [str(NOTEBOOK)]
    for name, value in settings.items():
        argv += [f"--{name}", "none" if value is None else str(value)]
    saved, sys.argv = sys.argv, argv
    namespace: dict = {"__name__": "__main__", "__file__": str(NOTEBOOK)}
    try:
        for source in cells:
            exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    finally:
        sys.argv = saved
    return namespace


def _force_offload(model, record: dict) -> None:
    from notebookkit.models.patching.checkpointing import _decoder_layers, apply_checkpointing, offload_checkpoint
    from notebookkit.compat import set_layer_checkpoint_function

    base = model.get_base_model()
    apply_checkpointing(model, True)
    state: dict = {}
    record["offload_calls"] = 0

    def counted(*args, **kwargs):
        record["offload_calls"] += 1
        return offload_checkpoint(*args, keep_on_device=False, state=state, **kwargs)

    for layer in _decoder_layers(base):
        set_layer_checkpoint_function(layer, counted)


def _plain_trainer(sft_trainer, callbacks):
    """A plain ``transformers.Trainer`` on the SFT trainer's tokenised data: the loss is then the one of
    notebookkit's patched causal-LM forward (fused linear cross-entropy with ``num_items_in_batch``),
    not TRL's fused LM head."""
    from transformers import Trainer

    return Trainer(
        model=sft_trainer.model,
        args=sft_trainer.args,
        train_dataset=sft_trainer.train_dataset,
        eval_dataset=sft_trainer.eval_dataset,  # the notebook's trainer evaluates on its held-back rows
        data_collator=sft_trainer.data_collator,
        callbacks=callbacks,
    )


def run_variant(cells: list[str], name: str, settings: dict, out: Path, force_offload: bool = False,
                trainer_kind: str = "sft", skip_allreduce: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    record: dict = {"allreduce_calls": [], "buckets": set(), "micro_batches": 0}
    holder: dict = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if force_offload:  # here, after the Trainer's gradient_checkpointing_enable re-applied the notebook's mode
                _force_offload(holder["model"], record)
            wrapped = holder["trainer"].model_wrapped
            record["wrapper"] = type(wrapped).__name__
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                record["find_unused_parameters"] = wrapped.find_unused_parameters
                trainer_state = state

                def counting_allreduce(process_group, bucket):
                    record["allreduce_calls"].append(trainer_state.global_step)
                    record["buckets"].add(bucket.index())
                    group = process_group if process_group is not None else dist.group.WORLD
                    tensor = bucket.buffer().div_(group.size())
                    if skip_allreduce:  # the negative control: each rank keeps its own gradient
                        fut = torch.futures.Future()
                        fut.set_result(tensor)
                        return fut
                    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
                    return fut.then(lambda f: f.value()[0])

                wrapped.register_comm_hook(None, counting_allreduce)

        def on_substep_end(self, args, state, control, **kwargs):
            record["micro_batches"] += 1

        def on_step_end(self, args, state, control, **kwargs):
            record["micro_batches"] += 1

    notebook = build_from_notebook(settings, cells)
    trainer, model, launch = notebook["trainer"], notebook["model"], notebook["LAUNCH"]
    if trainer_kind == "hf":
        trainer = _plain_trainer(trainer, [Probe()])
    else:
        trainer.add_callback(Probe())
    record["trainer"] = type(trainer).__name__
    holder.update(trainer=trainer, model=model)
    base = model.get_base_model()
    record["hf_device_map"] = getattr(base, "hf_device_map", None)
    record["lm_head_calls"] = 0

    def count_lm_head(module, inputs, output):
        if module.training:  # training steps only: the notebook's held-back evaluation computes logits on purpose
            record["lm_head_calls"] += 1

    handle = base.get_output_embeddings().register_forward_hook(count_lm_head)
    record["lora_init"] = {k: v.detach().float().cpu().clone() for k, v in model.named_parameters() if "lora_" in k}
    trainer.train()
    handle.remove()
    lora = {k: v.detach().float().cpu().clone() for k, v in model.named_parameters() if "lora_" in k}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rank = int(os.environ.get("RANK", "0"))
    record["buckets"] = sorted(record["buckets"])
    global_batch = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps * launch.world_size
    record.update(lora=lora, losses=losses, world_size=launch.world_size, global_batch=global_batch,
                  steps=trainer.state.global_step)
    torch.save(record, out / f"{name}.rank{rank}.pt")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", required=True,
                        help="JSON list of {name, settings (the notebook's parameters), force_offload, trainer, skip_allreduce}")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = notebook_cells_before_training()
    for variant in json.loads(args.variants):
        run_variant(cells, variant["name"], variant["settings"], out, bool(variant.get("force_offload")),
                    variant.get("trainer", "sft"), bool(variant.get("skip_allreduce")))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
