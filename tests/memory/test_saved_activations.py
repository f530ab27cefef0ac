"""The memory model's per-layer activations are what the fused path really saves for backward.

Tiny models of three families are loaded in bf16 through ``FastLanguageModel`` (LoRA r=8 on all
seven projections) and run on the CUDA code paths under the Triton interpreter
(``activation_probe.cuda_like``). Every storage saved for backward is counted once, per decoder
layer, and compared byte for byte with ``layer_activation_bytes``:

* llama: the plain SDPA path (Q, K, V, output, log-sum-exp; norms' inputs and 1/rms; e, g);
* qwen3: plus the per-head q/k norms;
* gemma2: sandwich norms and soft-capped attention (explicit softmax: K/V repeated to every head,
  the tanh output, the fp32 softmax and 16-bit probabilities, the boolean mask).

LoRA dropout (which leaves the fused path) is checked per adapter on PEFT's own layer: what dropout adds to
what an adapter saves when its input is saved anyway (as the fused path saves it).

The last layer is compared (the first one also pays for tables shared by all layers, such as
RoPE's cos/sin, and saves nothing for its first norm since the embeddings are frozen).
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory import layer_activation_bytes, model_shape

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


def test_recomputed_layers_keep_only_their_input():
    model, shape = _load("llama", True)
    ids = torch.randint(0, shape.vocab_size, (B, T))
    with cuda_like():
        saved = saved_bytes_by_layer(model, input_ids=ids, labels=ids)
    per_layer = layer_activation_bytes(shape, "recompute", batch_size=B, seq_len=T, dtype_bytes=2)
    assert per_layer == B * T * shape.hidden_size * 2
    for i in range(len(decoder_layers(model))):
        assert sum(saved[i].values()) == per_layer, (i, dict(saved[i]))


def _adapter_saved_bytes(in_features: int, out_features: int, dropout: float, dtype: torch.dtype) -> int:
    """Bytes one PEFT LoRA linear saves for backward, its input and parameters not counted (the input is
    saved by the layer anyway: the fused path keeps the normed input of q/k/v and gate/up)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False)).to(dtype)
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, lora_dropout=dropout, target_modules=["0"]), model)
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
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
        model.train()(x).sum().backward()
    return total


@pytest.mark.parametrize("targets, dtype", [(None, torch.bfloat16), (["q_proj", "o_proj", "down_proj"], torch.float32)],
                         ids=["all-bf16", "q-o-down-fp32"])
def test_lora_dropout_adds_what_peft_saves_for_it(targets, dtype):
    """``layer_activation_bytes`` with ``lora_dropout > 0`` exceeds the one without by what dropout makes PEFT's
    adapters save (the dropped input and dropout's mask), summed over the targeted projections of a decoder
    layer: measured per projection, from each one's input width."""
    cfg = dict(model_type="llama", hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, intermediate_size=80, vocab_size=64)
    H, dq, dk, I = 48, 32, 16, 80
    projections = {"q_proj": (H, dq), "k_proj": (H, dk), "v_proj": (H, dk), "o_proj": (dq, H),
                   "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    measured = sum(_adapter_saved_bytes(i, o, 0.1, dtype) - _adapter_saved_bytes(i, o, 0.0, dtype)
                   for name, (i, o) in projections.items() if targets is None or name in targets)
    shape = model_shape(cfg)
    kw = dict(batch_size=B, seq_len=T, dtype_bytes=torch.finfo(dtype).bits // 8, target_modules=targets)
    predicted = (layer_activation_bytes(shape, "keep", lora_dropout=0.1, **kw)
                 - layer_activation_bytes(shape, "keep", lora_dropout=0.0, **kw))
    assert measured > 0
    assert predicted == measured, f"the estimate adds {predicted} bytes for dropout, PEFT's adapters save {measured}"
