"""Tiny, randomly initialised models of every supported family, saved as Hugging Face folders.

Each family gets the same small body: hidden size 128, 4 query heads of dimension 32 sharing 2
key/value heads (grouped-query attention), an MLP of width 384 (3x), 2048 positions and the shared
2048-token byte-level BPE vocabulary. The rest comes from the family's row in
:mod:`notebookkit.families` (its tiny recipe: config class, layers, RoPE, further config
arguments; ``tiny-llama`` has 4 layers because it is pre-trained, the others 2). Family-specific
features stay on, so every code path of the real architectures runs:

=========  ==================================================================================
llama      SwiGLU, RMSNorm, RoPE theta 5e5 with ``llama3`` frequency scaling (factor 8 over an
           original 256-token window), tied embeddings (as Llama 3.2 1B/3B)
mistral    SwiGLU, RoPE theta 1e6, sliding window 1024, untied embeddings
qwen2      SwiGLU, bias on q/k/v projections, RoPE theta 1e6, tied embeddings
qwen3      SwiGLU, RMSNorm on q and k per head, RoPE theta 1e6, tied embeddings
gemma      GeGLU (tanh GELU), RMSNorm with ``(1 + w)``, embeddings scaled by ``sqrt(hidden)``
gemma2     gemma + attention soft-cap 50 and final-logit soft-cap 30, pre/post "sandwich" norms,
           alternating sliding (512) / global attention, ``query_pre_attn_scalar = head_dim``
gemma3     gemma2's sandwich norms + q/k norms, sliding (512, local RoPE theta 1e4) then global
           (RoPE theta 1e6) layers, no soft-caps (``Gemma3ForCausalLM``, ``gemma3_text``)
=========  ==================================================================================

Weights are drawn with ``torch.manual_seed(seed)`` by the library's own initialiser and saved in
float32, so a rebuild gives bit-identical ``model.safetensors``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

from notebookkit.families import family as family_record

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 384
MAX_POSITIONS = 2048

#: extra file in each folder recording family, parameter count, seed and pre-training losses
INFO_FILE = "notebookkit_tiny.json"

def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _rope(theta: float, scaling: dict | None = None) -> dict[str, Any]:
    """RoPE keyword arguments in the form the installed transformers expects.

    transformers 5 takes one ``rope_parameters`` dict (``rope_theta`` + ``rope_type`` + scaling
    fields); 4.x takes ``rope_theta`` and an optional ``rope_scaling`` dict.
    """
    if _transformers_major() >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    kwargs: dict[str, Any] = {"rope_theta": theta}
    if scaling:
        kwargs["rope_scaling"] = dict(scaling)
    return kwargs


def _gemma3_rope(global_theta: float, local_theta: float) -> dict[str, Any]:
    if _transformers_major() >= 5:
        return {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": global_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        }}
    return {"rope_theta": global_theta, "rope_local_base_freq": local_theta}


def family_config(family: str, vocab_size: int, token_ids: dict[str, Any]):
    """The ``transformers`` config object of tiny ``family`` (not yet a model).

    The shared body above, plus the family's tiny recipe (:class:`notebookkit.families.TinyRecipe`):
    its config class, layers, tied embeddings, RoPE and further config arguments (which override the
    body's: a mixture-of-experts recipe sets its experts' width and count).
    """
    import transformers as tf

    row = family_record(family)
    recipe = row.tiny
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=recipe.layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.02, bos_token_id=token_ids["bos_token_id"],
        eos_token_id=token_ids["config_eos_token_id"], pad_token_id=token_ids["pad_token_id"],
        dtype="float32", tie_word_embeddings=recipe.tie_word_embeddings,
    )
    if row.query_pre_attn_scalar:  # scores scaled by head_dim ** -0.5, as in the other families
        common["query_pre_attn_scalar"] = HEAD_DIM
    if recipe.local_rope_theta is not None:
        rope = _gemma3_rope(recipe.rope_theta, recipe.local_rope_theta)
    else:
        rope = _rope(recipe.rope_theta, dict(recipe.rope_scaling) if recipe.rope_scaling else None)
    # the recipe's arguments win over the shared body (gpt-oss's experts are narrower than the dense MLP)
    return getattr(tf, row.config_class)(**{**common, **copy.deepcopy(dict(recipe.config))}, **rope)


def build_random_model(family: str, vocab_size: int, token_ids: dict[str, Any], seed: int):
    """Instantiate tiny ``family`` with weights drawn from ``torch.manual_seed(seed)`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = family_config(family, vocab_size, token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


def save_model_folder(model, family: str, token_ids: dict[str, Any], folder: Path) -> None:
    """Save ``model`` (safetensors), its config and a ``generation_config.json`` into ``folder``."""
    from transformers import GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["bos_token_id"], eos_token_id=token_ids["eos_token_id"],
        pad_token_id=token_ids["pad_token_id"],
    )
    model.save_pretrained(folder, safe_serialization=True)


def count_parameters(model) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def pretrain_on_corpus(model, base_tokenizer, pretrain_config, train_docs: list[str] | None,
                       heldout_docs: list[str] | None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The short pre-training of ``model`` on the corpus (:mod:`.generate_pretrain`); returns its record."""
    from .generate_pretrain import pretrain, token_stream, windows

    if train_docs is None or heldout_docs is None:
        raise ValueError("pre-training needs train_docs and heldout_docs")
    bos, eot = "<|begin_of_text|>", "<|end_of_text|>"
    train = windows(token_stream(base_tokenizer, train_docs, bos, eot), pretrain_config.seq_len)
    held = windows(token_stream(base_tokenizer, heldout_docs, bos, eot), pretrain_config.seq_len)
    result = pretrain(model, train, held, pretrain_config, log=log)
    return {
        "steps": pretrain_config.steps, "tokens_seen": result.tokens_seen,
        "first_loss": round(result.losses[0], 4), "last_loss": round(result.losses[-1], 4),
        "heldout_loss_before": round(result.heldout_loss_before, 4),
        "heldout_loss_after": round(result.heldout_loss_after, 4), "seconds": round(result.seconds, 2),
    }


def build_model_folder(family: str, folder: Path, base_tokenizer, seed: int, pretrain_config=None,
                       heldout_docs: list[str] | None = None, train_docs: list[str] | None = None,
                       log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build one tiny model of ``family`` into ``folder`` (no caching); returns its info dict.

    ``pretrain_config`` (a :class:`~notebookkit.embedded.generate_pretrain.PretrainConfig`) switches
    on pre-training, which then needs ``train_docs`` and ``heldout_docs``.
    """
    from .generate_tokenizer import special_token_ids, write_tokenizer_folder

    ids = special_token_ids(base_tokenizer, family)
    model = build_random_model(family, base_tokenizer.get_vocab_size(), ids, seed)
    info: dict[str, Any] = {"family": family, "params": count_parameters(model), "seed": seed,
                            "pretrained": pretrain_config is not None}
    if pretrain_config is not None:
        info["pretrain"] = pretrain_on_corpus(model, base_tokenizer, pretrain_config, train_docs, heldout_docs, log)
    save_model_folder(model, family, ids, folder)
    write_tokenizer_folder(base_tokenizer, family, folder)
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return info
