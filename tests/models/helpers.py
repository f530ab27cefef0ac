"""Small random models of every supported family, for the model-layer tests (CPU, fp32).

``tiny_folder(family)`` prefers the project's embedded tiny default (``notebookkit.embedded.tiny``)
and falls back to a folder built here (hidden 64, 2 layers, a byte-level tokenizer) so the tests
also run while that module is absent.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import torch

from notebookkit.families import FAMILIES as FAMILY_RECORDS

# The dense families, which the shared model-layer tests (patch parity, training parity, 4-bit, decode,
# low-bit) run on; the mixture-of-experts families have their own lean tests (tests/models/test_moe.py,
# test_moe_nf4.py, generation/test_moe_decode.py).
FAMILIES = [name for name, row in FAMILY_RECORDS.items() if row.moe is None]
MOE_FAMILIES = [name for name, row in FAMILY_RECORDS.items() if row.moe is not None]
_CACHE = Path(os.environ.get("NOTEBOOKKIT_TEST_MODELS", tempfile.gettempdir())) / "notebookkit-models-tests"

_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# Test-sized values of the features a family's tiny recipe switches on, so that they act on
# sequences of a few dozen tokens: an 8-token sliding window, small soft-caps, llama3 RoPE scaling
# over a 64-token original window.
_TEST_WINDOW = 8
_TEST_SOFTCAPS = {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0}
_COPIED = ("hidden_act", "hidden_activation", "layer_types")
# A mixture-of-experts recipe's experts (count, width, top-k, routing and activation settings) as they are
_MOE_COPIED = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "router_aux_loss_coef", "swiglu_limit", "attention_bias")


def family_config(family: str, vocab_size: int = 300, **overrides):
    """A small config of ``family``: its record's config class and features (notebookkit.families)."""
    import transformers as tf

    row = FAMILY_RECORDS[family]
    recipe = row.tiny.config
    c = dict(_COMMON, vocab_size=vocab_size, bos_token_id=256, eos_token_id=257, pad_token_id=None)
    c.update({k: copy.deepcopy(recipe[k]) for k in _COPIED if k in recipe})
    if row.moe is not None:
        c.update({k: recipe[k] for k in _MOE_COPIED if k in recipe})
        c["intermediate_size"] = recipe.get("intermediate_size", c["intermediate_size"])
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": row.tiny.rope_theta}
    if row.tiny.rope_scaling:
        c["rope_parameters"] = {**row.tiny.rope_scaling, "rope_theta": row.tiny.rope_theta,
                                "original_max_position_embeddings": 64}
    if "sliding_window" in recipe:
        c["sliding_window"] = _TEST_WINDOW
    if row.query_pre_attn_scalar:
        c["query_pre_attn_scalar"] = c["head_dim"]
    c.update({k: v for k, v in _TEST_SOFTCAPS.items() if recipe.get(k) is not None})
    cfg = getattr(tf, row.config_class)(**c)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def random_model(family: str, seed: int = 0, **overrides):
    """A randomly initialised causal LM (fp32, eager weights) with non-trivial norm weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = family_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: 256 byte tokens + <s>, </s> (no pad token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    return fast


def tiny_folder(family: str) -> str:
    """A saved model folder for ``family`` (the embedded tiny default when available)."""
    try:
        from notebookkit.embedded.tiny import TINY_MODELS, ensure_tiny_model

        name = f"notebookkit/tiny-{family}"
        if name in TINY_MODELS:
            return str(ensure_tiny_model(name))
    except Exception:  # noqa: BLE001 - fall back to a local build
        pass
    return local_folder(family)


def local_folder(family: str) -> str:
    """A model folder built by this helper (cached per process run in the temp dir)."""
    folder = _CACHE / family
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        model = random_model(family)
        model.save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
    return str(folder)


def train_losses(model, batches: list[dict], steps: int, lr: float, first_grads: dict | None = None) -> list[float]:
    """``steps`` AdamW steps over ``batches`` (cycled) on the trainable parameters; the loss of each step.

    ``first_grads``, when given, receives fp32 CPU copies of the first step's gradients (by name)."""
    model.train()
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    # eps=1e-6: coordinates whose gradient is at rounding-noise level (|g| << eps) then get tiny updates
    # instead of full +-lr steps of arbitrary sign, so two runs compare arithmetic, not noise.
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, eps=1e-6)
    losses = []
    for step in range(steps):
        out = model(**batches[step % len(batches)])
        out.loss.backward()
        if step == 0 and first_grads is not None:
            first_grads.update({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()
                                if p.requires_grad and p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


def assert_moe_lora_grads_match(got: dict, want: dict, layers: int, rtol: float = 1e-4) -> None:
    """Every LoRA gradient of a mixture-of-experts model (names to tensors) within ``rtol`` of the reference's,
    non-zero, with the two stacked expert weights' ``A`` and ``B`` adapted in each of ``layers`` layers."""
    from notebookkit.kernels.testing import rel_err

    assert got.keys() == want.keys()
    assert sum("experts" in n for n in want) == 4 * layers
    for name, g in want.items():
        assert g.abs().sum() > 0, name
        assert rel_err(got[name], g) <= rtol, f"{name}: {rel_err(got[name], g):.2e}"
