"""Merged 16-bit export of an 8B-shaped NF4 model with non-zero LoRA adapters: notebookkit against
Unsloth's ``save_pretrained_merged``, each system in its own process, in one run.

Per system and setting it records: wall time of the export, peak GPU memory allocated during it
(``torch.cuda.max_memory_allocated`` after a reset, and its rise above the loaded model), peak host
RSS sampled every 20 ms during the export minus the RSS just before it, and the shard files written.

Settings: ``budget`` = ``maximum_memory_usage=0.5``; ``cap15`` = the same under
``torch.cuda.set_per_process_memory_fraction`` for 15 GiB (a T4's usable memory), set in the
child before the model loads, so the export's budget is ``min(0.5 x card, 15 GiB)``. Each row says
whether the GPU peak stayed under that budget and the host RSS rise under the 4 GiB target.

    python benchmarks/export.py --out runs/export                       # GPU: both systems, both settings
    python benchmarks/export.py --out runs/export --settings cap15      # GPU: the 15 GiB cap only
    python benchmarks/export.py --out runs/export --systems notebookkit --shape tiny   # CPU smoke test

Unsloth is imported only in its own child process (it patches transformers on import).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETTINGS = {"budget": None, "cap15": 15 * 2**30}
HOST_RSS_TARGET = 4 * 2**30  # the target for the host RSS rise during the export


def random_checkpoint(shape: str, root: Path) -> Path:
    """A random-weight Llama checkpoint (bf16) with a small byte-level tokenizer, built once."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = root / f"ckpt-{shape}"
    if (folder / "config.json").exists():
        return folder
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    fast.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def load(system: str, checkpoint: Path):
    import torch

    if system == "unsloth":
        from unsloth import FastLanguageModel
    else:
        from notebookkit import FastLanguageModel
    kw = dict(max_seq_length=2048, load_in_4bit=True)
    if torch.cuda.is_available():
        kw["dtype"] = torch.bfloat16
    model, tokenizer = FastLanguageModel.from_pretrained(str(checkpoint), **kw)
    peft_kw = dict(r=16, lora_alpha=16, lora_dropout=0, bias="none", target_modules=TARGETS, random_state=3407)
    model = FastLanguageModel.get_peft_model(model, **peft_kw)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():  # non-zero adapters, so the merge has something to add
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype))
    return model, tokenizer


def child(system: str, setting: str, checkpoint: Path, out: Path) -> dict:
    """One export in this process; returns the measured row."""
    if system == "unsloth":
        import unsloth  # noqa: F401  (before transformers, as Unsloth requires)
    import torch

    cuda = torch.cuda.is_available()
    cap = SETTINGS[setting]
    if cap is not None and cuda:
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    model, tokenizer = load(system, checkpoint)
    target = out / f"merged-{system}-{setting}"
    shutil.rmtree(target, ignore_errors=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    loaded = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    from notebookkit.memory.meters import HostMemorySampler

    with HostMemorySampler(0.02) as rss:
        model.save_pretrained_merged(str(target), tokenizer, save_method="merged_16bit",
                                     maximum_memory_usage=0.5, max_shard_size="5GB")
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    shards = sorted((p.name, p.stat().st_size) for p in target.glob("*.safetensors"))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    budget = min(0.5 * torch.cuda.get_device_properties(0).total_memory, cap or float("inf")) if cuda else None
    row = {
        "system": system, "setting": setting, "wall_s": round(wall, 2),
        "cap_gib": round(cap / 2**30, 3) if cap is not None and cuda else None,
        "gpu_loaded_gib": round(loaded / 2**30, 3),
        "gpu_peak_gib": round(peak / 2**30, 3) if cuda else None,
        "gpu_budget_gib": round(budget / 2**30, 3) if cuda else None,
        "gpu_under_budget": bool(peak <= budget) if cuda else None,
        "host_rss_before_gib": round(rss.before / 2**30, 3), "host_rss_peak_gib": round(rss.peak_rss / 2**30, 3),
        "host_rss_rise_gib": round((rss.peak_rss - rss.before) / 2**30, 3),
        "host_anon_peak_gib": round(rss.peak_anon / 2**30, 3),
        "host_rss_within_target": bool(rss.peak_rss - rss.before <= HOST_RSS_TARGET),
        "shards": [(n, round(s / 1e9, 3)) for n, s in shards], "total_gb": round(sum(s for _, s in shards) / 1e9, 3),
    }
    if system == "notebookkit" and cuda:  # the budget notebookkit's export computed (the cap must show in it)
        from notebookkit.export.merged import MergeDevice

        row["notebookkit_budget_gib"] = round(MergeDevice(0.5).budget(torch.device("cuda", 0)) / 2**30, 3)
    shutil.rmtree(target, ignore_errors=True)  # 16 GB each: keep the disk for the next row
    return row


def versions() -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/export")
    ap.add_argument("--systems", default="notebookkit,unsloth")
    ap.add_argument("--settings", default="budget,cap15")
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "SETTING"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(os.path.expanduser("~")) / ".cache" / "notebookkit-bench"
    if args.child:
        row = child(args.child[0], args.child[1], random_checkpoint(args.shape, checkpoint), out)
        print("ROW " + json.dumps(row), flush=True)
        return
    random_checkpoint(args.shape, checkpoint)
    rows = []
    for setting in args.settings.split(","):
        for system in args.systems.split(","):
            cmd = [sys.executable, __file__, "--out", str(out), "--shape", args.shape, "--child", system, setting]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            found = [l for l in proc.stdout.splitlines() if l.startswith("ROW ")]
            if proc.returncode != 0 or not found:
                row = {"system": system, "setting": setting, "error": (proc.stderr or proc.stdout)[-2000:]}
            else:
                row = json.loads(found[-1][4:])
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"shape": args.shape, "versions": versions(), "rows": rows}
    (out / f"export-{args.shape}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| system | setting | wall s | GPU loaded GiB | GPU peak GiB | budget GiB | under budget | host RSS rise GiB | "
             "<= 4 GiB | shards (GB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['setting']} | error: {r['error'].splitlines()[-1][:80] if r['error'] else ''} |||||||")
            continue
        shards = ", ".join(f"{s}" for _, s in r["shards"])
        lines.append(f"| {r['system']} | {r['setting']} | {r['wall_s']} | {r['gpu_loaded_gib']} | {r['gpu_peak_gib']} | "
                     f"{r['gpu_budget_gib']} | {r['gpu_under_budget']} | {r['host_rss_rise_gib']} | {r['host_rss_within_target']} | {shards} |")
    (out / f"export-{args.shape}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
