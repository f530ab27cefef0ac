"""The mixture-of-experts families (Qwen3-MoE, gpt-oss) on the GPU in bf16 and fp16 (the T4's dtype).

tests/models/test_moe.py shows the fused path equal to transformers + PEFT in fp32 on a CPU; this is the same
comparison where the Triton kernels run, in 16 bits. Per family a small random model (hidden 256, 3 layers, 8
experts, top-2, experts 128 wide; gpt-oss with alternating 8-token sliding windows and fp32 norms, as
``from_pretrained`` keeps them), LoRA r=8 on the attention projections and both stacked expert weights (PEFT's
``target_parameters``, random ``B``), ``output_router_logits=True``, one right-padded batch, and three runs of
one forward + backward: the oracle (HF + PEFT in fp32), HF + PEFT in the 16-bit dtype, ours in that dtype.

* Loss, ``aux_loss`` and every LoRA gradient (attention and experts, every layer): ours may be at most ``K = 3``
  times as far from the oracle as HF + PEFT is, plus a small ``FLOOR`` (relative errors). HF + PEFT's distance
  is the 16-bit noise of this very computation, measured rather than guessed (1-5% of a gradient in bf16,
  0.1-0.7% in fp16). 3 as in test_gpu.py: a tensor's error averages thousands of roundings, so two honest
  implementations land about equally far (ours / HF + PEFT at most 1.43 over every tensor of 10 seeds of
  weights, both families and dtypes, on a CPU with the kernels' PyTorch references). So the test sees what is
  wrong by more than ~3x the noise (a lost aux-loss gradient, a stale adapter, a broken tile); smaller errors (in
  bf16 even expert outputs 5% too large) are test_moe.py's to catch, in fp32. ``FLOOR`` covers the scalars,
  whose 16-bit error can come out near zero by chance, and fp32 (test_moe.py's bound; a check on a CPU).
* Routing is made decisive (:func:`_decisive_routing`: top-2 ahead of the third by 4+ logits), so no run picks
  other experts than the oracle. Left random, ~2% of the routing decisions flip in bf16, each moving a whole
  token's MLP output; the noise floor became those few flips (10-30% of a gradient, 2x apart run to run).
* ``router_aux_loss_coef=1.0`` (models ship 0.001-0.01): the aux loss's share of the gradients below each
  router is then up to 17% (median 7-10%), above the 16-bit noise.
* Gradient checkpointing (``apply_checkpointing``: ``True``, and ``"offload"``, which a mixture of experts runs
  as torch's recompute for now, #36): the same bound, and within a quarter of the noise floor of the run
  without it.
* Nothing inf or NaN (loss, aux loss, router logits, gradients) in either 16-bit run; fp16's backward runs at
  the loss scaler's initial scale (65536), as fp16 training does.

``DEVICE``, ``DTYPES``, ``ORACLE`` are module constants: the bodies also run on a CPU in fp32 (``TRITON_INTERPRET=1``
for the kernels). HF's experts run their eager loop (``grouped_mm``, its CUDA default, is a bf16 kernel).
"""

from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import pytest
import torch

from notebookkit.families import FAMILIES as FAMILY_RECORDS
from notebookkit.kernels.testing import rel_err
from notebookkit.models.patching.checkpointing import apply_checkpointing
from notebookkit.models.patching.patch_moe import experts_status
from notebookkit.models.patching.patcher import patch_model, patch_summary

from .helpers import MOE_FAMILIES, family_config, random_model

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16]
ORACLE = torch.float32
K = 3
# the absolute allowance on top of K x HF + PEFT's distance (relative errors; fp32: test_moe.py's gradient bound)
FLOOR = {torch.bfloat16: 2e-3, torch.float16: 3e-4, torch.float32: 1e-4}
# fp16 trains under a loss scaler; the backward runs at its initial scale (the gradients are divided back)
LOSS_SCALE = {torch.float16: 65536.0}
LAYERS = 3
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CHECKPOINTING = [False, True, "offload"]


class Run(NamedTuple):
    loss: float
    aux: float
    grads: dict  # LoRA parameter name -> fp64 gradient on the CPU


@functools.cache
def _weights(family: str):
    """(the fp32 CPU model, its adapters' values by name): every run of ``family`` starts from these."""
    import peft

    moe = FAMILY_RECORDS[family].moe
    overrides = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_hidden_layers=LAYERS, num_experts_per_tok=2, output_router_logits=True,
                     router_aux_loss_coef=1.0, _experts_implementation="eager",
                     **{moe.num_experts: 8, moe.intermediate: 128})
    types = getattr(family_config(family), "layer_types", None)
    if types:
        overrides["layer_types"] = [types[i % len(types)] for i in range(LAYERS)]
    model = random_model(family, vocab_size=512, **overrides)
    _decisive_routing(model, moe)
    torch.manual_seed(1)
    adapted = peft.get_peft_model(copy.deepcopy(model), _lora_config())
    adapters = {n: p.detach().clone() for n, p in adapted.named_parameters() if "lora_" in n}
    return model, adapters


def _decisive_routing(model, moe, lead: float = 30.0, reads: float = 2.0) -> None:
    """Every token's top-2 experts lead the third by several logits in every layer (module docstring).

    Token ``t``'s embedding gets ``lead`` on two of the first ``E`` hidden dims (``t mod E`` and another one
    by ``t``), which the residual stream carries through the layers; layer ``l``'s router reads dim ``d`` for
    expert ``(d - l) mod E`` (``reads`` added to its random weights). The random rest of the logits still
    splits the weight between the two."""
    n = model.config.vocab_size
    experts = getattr(model.config, moe.num_experts)
    t = torch.arange(n)
    first, second = t % experts, (t % experts + 1 + (t // experts) % (experts - 1)) % experts
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[t, first] += lead
        emb[t, second] += lead
        for l, layer in enumerate(model.model.layers):
            router = getattr(layer.mlp, moe.router).weight
            router[torch.arange(experts), (torch.arange(experts) + l) % experts] += reads


def _lora_config():
    import peft

    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION, target_parameters=EXPERTS,
                           init_lora_weights=False)


def _batch():
    """4 rows of 48 token ids, right-padded to 48, 29 and 37 real tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (4, 48), generator=g)
    mask = torch.ones_like(ids)
    for row, length in ((1, 29), (3, 37)):
        mask[row, length:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {k: v.to(DEVICE) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}


def _run(family: str, dtype: torch.dtype, fused: bool, checkpointing=False) -> Run:
    """One forward and backward of ``family`` in ``dtype``: the patched model (``fused``) or plain HF + PEFT."""
    import peft

    base, adapters = _weights(family)
    model = copy.deepcopy(base).to(DEVICE)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())  # gpt-oss's norms, as from_pretrained does
    for name, p in model.named_parameters():
        if not keep & set(name.split(".")):
            p.data = p.data.to(dtype)
    if fused:
        patch_model(model)
    model = peft.get_peft_model(model, _lora_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(adapters[name])  # in the dtype PEFT keeps adapters in (fp32)
    if fused:
        assert patch_summary(model)["moe"] == LAYERS
        for layer in model.base_model.model.model.layers:  # the fused experts run, not PEFT's fallback
            assert experts_status(layer.mlp, FAMILY_RECORDS[family].moe) is None
    if checkpointing is not False:  # a mixture of experts recomputes (offload too, for now: #36)
        assert apply_checkpointing(model, checkpointing) == "recompute"
    model.train()
    out = model(**_batch())
    scale = LOSS_SCALE.get(dtype, 1.0)
    (out.loss * scale).backward()
    assert all(torch.isfinite(z).all() for z in out.router_logits), f"{family} {dtype} fused={fused}: router logits"
    grads = {n: p.grad.detach().double().cpu() / scale for n, p in model.named_parameters() if p.requires_grad}
    return Run(out.loss.item(), out.aux_loss.item(), grads)


@functools.cache
def _cached(family: str, dtype: torch.dtype, fused: bool) -> Run:
    return _run(family, dtype, fused)


def _finite(run: Run, who: str) -> None:
    bad = [n for n, g in run.grads.items() if not torch.isfinite(g).all()]
    assert torch.isfinite(torch.tensor([run.loss, run.aux])).all() and not bad, f"{who}: inf/NaN in loss or {bad[:3]}"


@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=["keep", "recompute", "offload"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_loss_aux_loss_and_lora_gradients_within_the_noise_floor(family, dtype, checkpointing):
    exact, hf = _cached(family, ORACLE, False), _cached(family, dtype, False)
    ours = _run(family, dtype, True, checkpointing) if checkpointing else _cached(family, dtype, True)
    _finite(hf, f"HF + PEFT in {dtype}")
    _finite(ours, f"notebookkit in {dtype}")
    floor = FLOOR[dtype]
    for what in ("loss", "aux"):
        want, theirs, got = getattr(exact, what), getattr(hf, what), getattr(ours, what)
        noise = abs(theirs - want) / abs(want)
        err = abs(got - want) / abs(want)
        print(f"[{family} {dtype} {checkpointing}] {what}: ours {err:.2e}, HF {noise:.2e}")
        assert err <= K * noise + floor, f"{what}: ours {got} vs {want} ({err:.2e}), HF + PEFT {theirs} ({noise:.2e})"
    # attention (4 projections x A, B) and experts (2 stacked weights x A, B), every layer
    assert ours.grads.keys() == exact.grads.keys() == hf.grads.keys()
    assert len(exact.grads) == 12 * LAYERS and sum("experts" in n for n in exact.grads) == 4 * LAYERS
    worst = (0.0, "")
    for name, want in exact.grads.items():
        assert want.abs().sum() > 0, name
        noise, err = rel_err(hf.grads[name], want), rel_err(ours.grads[name], want)
        worst = max(worst, (err / (K * noise + floor), name))
        assert err <= K * noise + floor, f"{name}: ours {err:.2e}, HF + PEFT {noise:.2e} from the fp32 oracle"
    print(f"[{family} {dtype} {checkpointing}] gradients: worst ours / allowed {worst[0]:.2f} ({worst[1]})")
    if checkpointing:  # the same gradients as without: far inside the noise floor
        plain = _cached(family, dtype, True)
        for name, g in plain.grads.items():
            same, noise = rel_err(ours.grads[name], g), rel_err(hf.grads[name], exact.grads[name])
            assert same <= noise / 4 + floor, f"{name}: {same:.2e} from the run without checkpointing"
