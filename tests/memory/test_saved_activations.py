"""The memory model's per-layer activations are what the fused path really saves for backward.

Tiny models of three families are loaded in bf16 through ``FastLanguageModel`` (LoRA r=8 on all
seven projections) and run on the CUDA code paths under the Triton interpreter
(``activation_probe.cuda_like``). Every storage saved for backward is counted once, per decoder
layer, and compared byte for byte with ``layer_activation_bytes``:

* llama: the plain SDPA path (Q, K, V, output, log-sum-exp; norms' inputs and 1/rms; e, g);
* qwen3: plus the per-head q/k norms;
* gemma2: sandwich norms and soft-capped attention (explicit softmax: K/V repeated to every head,
  the tanh output, the fp32 softmax and 16-bit probabilities, the boolean mask).

LoRA dropout > 0 moves the targeted groups onto PEFT's code: what its adapters save is measured on PEFT's own
layer (fast), and a whole layer with dropout on some projections is compared on llama and gemma2 (slow).

The last layer is compared (the first one also pays for tables shared by all layers, such as
RoPE's cos/sin, and saves nothing for its first norm since the embeddings are frozen).
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory import layer_activation_bytes, model_shape
from notebookkit.memory.estimate import saved_low_rank_bytes

from .activation_probe import cuda_dropout, cuda_like, decoder_layers, saved_bytes_by_layer

B, T = 2, 32


def _load(family: str, checkpointing):
    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(f"notebookkit/tiny-{family}"))
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=torch.bfloat16, load_in_4bit=False,
                                                 show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, use_gradient_checkpointing=checkpointing,
                                             show_banner=False)
    return model.train(), model_shape(path)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_kept_layer_saves_exactly_what_the_model_says(family):
    model, shape = _load(family, False)
    ids = torch.randint(0, shape.vocab_size, (B, T))
    # With an attention mask, as trainers' collators pass it: Hugging Face builds the layer masks.
    with cuda_like():
        saved = saved_bytes_by_layer(model, input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    last = len(decoder_layers(model)) - 1
    predicted = layer_activation_bytes(shape, "keep", batch_size=B, seq_len=T, dtype_bytes=2, lora_r=8)
    assert sum(saved[last].values()) == predicted, (family, dict(saved[last]))
    # Without one the forward is plainly causal: no Hugging Face mask, and the soft-capped attention
    # (gemma2) saves its own [T, T] causal mask instead of the [B, 1, T, T] one.
    with cuda_like():
        plain = saved_bytes_by_layer(model, input_ids=ids, labels=ids)
    mask_saving = (B - 1) * T * T if family == "gemma2" else 0
    assert sum(plain[last].values()) == predicted - mask_saving, (family, dict(plain[last]))
    # After the layers: the final norm's input (bf16) and its 1/rms (fp32), nothing else.
    assert dict(saved["other"]) == {"bfloat16": B * T * shape.hidden_size * 2, "float32": B * T * 4}


@pytest.mark.parametrize("capability, padded", [((9, 0), True), ((7, 5), False)], ids=["padded-h100", "t4"])
def test_repeated_kv_of_a_padded_batch_or_a_t4_are_counted(capability, padded):
    """SDPA's flash kernel is the only CUDA one that reads grouped K/V: with a padding mask, or on a T4
    (7.5), the attention repeats K/V to every query head and SDPA saves those copies (2*dq, not 2*dk);
    a padding mask is also kept, as an additive [B, 1, T, T] mask in the compute dtype."""
    model, shape = _load("llama", False)
    assert shape.kv_dim < shape.q_dim
    ids = torch.randint(0, shape.vocab_size, (B, T))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -5:] = 0  # right padding: a collator's batch
    with cuda_like(capability=capability):
        saved = saved_bytes_by_layer(model, input_ids=ids, attention_mask=mask, labels=ids)
    last = len(decoder_layers(model)) - 1
    kw = dict(batch_size=B, seq_len=T, dtype_bytes=2, lora_r=8)
    predicted = layer_activation_bytes(shape, "keep", kv_repeated=True, padded=padded, **kw)
    assert sum(saved[last].values()) == predicted, dict(saved[last])
    # what the two facts add: the repeated K/V, and SDPA's additive copy of the padding mask
    assert predicted - layer_activation_bytes(shape, "keep", **kw) \
        == 2 * B * T * (shape.q_dim - shape.kv_dim) * 2 + padded * B * T * T * 2


def test_recomputed_layers_keep_only_their_input():
    model, shape = _load("llama", True)
    ids = torch.randint(0, shape.vocab_size, (B, T))
    with cuda_like():
        saved = saved_bytes_by_layer(model, input_ids=ids, labels=ids)
    per_layer = layer_activation_bytes(shape, "recompute", batch_size=B, seq_len=T, dtype_bytes=2)
    assert per_layer == B * T * shape.hidden_size * 2
    for i in range(len(decoder_layers(model))):
        assert sum(saved[i].values()) == per_layer, (i, dict(saved[i]))


def _adapter_saved_bytes(in_features: int, r: int, dtype: torch.dtype, adapter_dtype: torch.dtype) -> int:
    """Bytes one PEFT LoRA linear with dropout 0.1 saves for backward, on an input of ``B * T`` rows in ``dtype``
    with the adapter weights in ``adapter_dtype`` (the input and the parameters themselves not counted)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.Sequential(torch.nn.Linear(in_features, 16, bias=False)).to(dtype)
    model = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=r, lora_dropout=0.1, target_modules=["0"]), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    x = torch.randn(B * T, in_features, dtype=dtype, requires_grad=True)  # a layer's input needs its gradient
    known = {t.untyped_storage().data_ptr() for t in (x, *model.parameters())}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in known:
            known.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with cuda_dropout(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()(x).float().sum().backward()
    return total


TINY = dict(model_type="llama", hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=80, vocab_size=64)
H, DQ, DK, I = 48, 32, 16, 80
IN_FEATURES = {"q_proj": H, "k_proj": H, "v_proj": H, "o_proj": DQ, "gate_proj": H, "up_proj": H, "down_proj": I}


@pytest.mark.parametrize("targets, dtype, adapter_dtype", [
    (None, torch.bfloat16, torch.float32),  # PEFT's fp32 adapters on a bf16 model
    (["q_proj", "o_proj", "down_proj"], torch.bfloat16, torch.float32),
    (["o_proj", "up_proj"], torch.float32, torch.float32),
], ids=["all-bf16", "q-o-down-bf16", "o-up-fp32"])
def test_lora_dropout_saves_what_peft_adapters_save(targets, dtype, adapter_dtype):
    """With ``lora_dropout > 0`` the targeted groups run on PEFT's code: a kept layer's bytes change by what each
    targeted PEFT adapter saves (measured: dropout's mask, the input dropped in the adapters' dtype, ``x A^T``),
    less what only the fused kernels kept: the normed inputs of q/k/v and of the MLP (``H`` each, for a group
    with a target) and the rank-space inputs ``s x A^T`` (``r`` a targeted projection but down)."""
    r = 4
    names = list(IN_FEATURES) if targets is None else targets
    adapters = sum(_adapter_saved_bytes(IN_FEATURES[n], r, dtype, adapter_dtype) for n in names)
    s = torch.finfo(dtype).bits // 8
    groups = sum(any(n in names for n in g) for g in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj")))
    kw = dict(batch_size=B, seq_len=T, dtype_bytes=s, lora_r=r, target_modules=targets,
              adapter_dtype_bytes=torch.finfo(adapter_dtype).bits // 8)
    shape = model_shape(TINY)
    change = (layer_activation_bytes(shape, "keep", lora_dropout=0.1, **kw)
              - layer_activation_bytes(shape, "keep", lora_dropout=0.0, **kw))
    fused_low_rank = saved_low_rank_bytes(B * T, r, s, names)
    assert change == adapters - groups * B * T * H * s - fused_low_rank, (change, adapters, groups)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_kept_layer_with_lora_dropout_saves_what_the_model_says(family):
    """The whole layer with LoRA dropout on some projections (PEFT's code there, the fused kernels elsewhere) on
    the tiny model: byte for byte the estimate (gemma2: the explicit softmax saves no attention output, which
    then only o's adapter keeps, as its dropped copy)."""
    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(f"notebookkit/tiny-{family}"))
    targets = ["k_proj", "o_proj", "gate_proj"]
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=torch.bfloat16, load_in_4bit=False,
                                                 show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, lora_dropout=0.1, target_modules=targets,
                                             use_gradient_checkpointing=False, show_banner=False).train()
    shape = model_shape(path)
    ids = torch.randint(0, shape.vocab_size, (B, T))
    with cuda_like(), cuda_dropout():
        saved = saved_bytes_by_layer(model, input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    last = len(decoder_layers(model)) - 1
    predicted = layer_activation_bytes(shape, "keep", batch_size=B, seq_len=T, dtype_bytes=2, lora_r=8,
                                       target_modules=targets, lora_dropout=0.1, adapter_dtype_bytes=4)
    assert sum(saved[last].values()) == predicted, (family, dict(saved[last]))
