"""GPU checks of 2-bit and ternary bases (run on the GPU machine: ``pytest -m gpu tests/models/low_bit -s``).

* one fused LoRA training step in bf16 and fp16 (the T4's dtype; Gemma's explicit fp16 load refused) on a 2-bit / ternary base, every
  family, against the fp32 dense twin on stock code (:func:`.common.dense_twin`, the weights the codes
  decode to): loss and every LoRA gradient within ``BOUND`` (16-bit rounding of activations and of the
  decoded tile; the CPU tests bound the fp32 path at 1e-4);
* the Triton kernels run (CUDA tensors): a step leaves no dense weight behind (peak memory of the
  step below that of one dequantised projection per layer);
* decode: the fast ``generate`` with CUDA graphs gives the tokens of the same steps run eagerly
  (``NOTEBOOKKIT_CUDA_GRAPHS=0``), bf16, LoRA attached.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit import families
from notebookkit.kernels.testing import rel_err
from notebookkit.models import FastLanguageModel

from ..helpers import FAMILIES
from .common import batch, checkpoint, dense_twin, load, with_lora

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BOUND = {"bf16": 5e-2, "fp16": 1e-2}


def _cuda_batch():
    return {k: v.cuda() for k, v in batch().items()}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_lora_step_on_cuda_equals_the_fp32_dense_twin(family, base_format, dtype):
    if dtype == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    if dtype == "fp16" and families.family(family).fp16_overflow is not None:
        # Gemma's activations leave fp16's range: an explicit fp16 load is refused with the reason
        with pytest.raises(ValueError, match="dtype=float16 cannot train or run"):
            load(checkpoint(family), base_format, dtype=DTYPES[dtype], device_map={"": 0})
        return
    model, _ = load(checkpoint(family), base_format, dtype=DTYPES[dtype], device_map={"": 0})
    model = with_lora(model)
    assert model.notebookkit_banner.is_on("LoRA fast path")
    twin = dense_twin(model).float()
    model.train()
    twin.train()
    b = _cuda_batch()
    out, ref = model(**b), twin(**b)
    out.loss.backward()
    ref.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    assert all(torch.isfinite(g).all() for g in grads.values())
    loss_err = abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item())
    worst = max(rel_err(grads[n].float(), ref_grads[n]) for n in grads)
    print(f"\n[{family} {base_format} {dtype}] loss rel. error {loss_err:.1e}, worst LoRA grad rel. error {worst:.1e}")
    assert loss_err <= BOUND[dtype] and worst <= BOUND[dtype]


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_cuda_graph_decode_equals_eager_decode(base_format, monkeypatch):
    model, _ = load(checkpoint("llama"), base_format, dtype=torch.bfloat16, device_map={"": 0})
    model = with_lora(model)
    FastLanguageModel.for_inference(model)
    prompt = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(3)).cuda()
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        graphs = model.generate(input_ids=prompt, **kw)
        monkeypatch.setenv("NOTEBOOKKIT_CUDA_GRAPHS", "0")
        eager = model.generate(input_ids=prompt, **kw)
    assert torch.equal(graphs, eager), f"\ngraphs {graphs[:, 6:].tolist()}\neager  {eager[:, 6:].tolist()}"


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_decode_projection_equals_the_dense_product_on_cuda(base_format):
    """One decode row through the fused projections (``low_bit_matvec``) against ``x W^T`` of the
    decoded weight, bf16."""
    from notebookkit.models.generation.projections import project

    model, _ = load(checkpoint("llama"), base_format, dtype=torch.bfloat16, device_map={"": 0})
    attn = model.model.layers[0].self_attn
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(1, 64, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        got = project(x, mods)
        want = [(x.float() @ m.dequantized_weight(torch.bfloat16).float().t()) for m in mods]
    for g, w in zip(got, want):
        assert rel_err(g.float(), w) < 1e-2


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_loading_never_holds_the_16bit_model_on_the_gpu(base_format):
    """Peak GPU memory of a low-bit load (hidden 512, MLP 1536, 24 layers: 150 MB of bf16 projections) stays
    under the packed model plus one projection and the fit's temporaries (chunked: a constant, 64 MiB
    allowed), under half the 16-bit projections alone."""
    path = checkpoint("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model, _ = load(path, base_format, dtype=torch.bfloat16, device_map={"": 0})
    peak = torch.cuda.max_memory_allocated() - start
    held = torch.cuda.memory_allocated() - start
    layers = [m for m in model.modules() if hasattr(m, "dequantized_weight")]
    dense16 = sum(2 * m.in_features * m.out_features for m in layers)
    largest = max(2 * m.in_features * m.out_features for m in layers)
    print(f"\n[{base_format}] peak {peak / 2**20:.1f} MiB, held {held / 2**20:.1f} MiB, "
          f"16-bit projections {dense16 / 2**20:.1f} MiB, largest one {largest / 2**20:.1f} MiB")
    assert peak <= held + largest + 64 * 2**20 and peak < 0.5 * dense16
