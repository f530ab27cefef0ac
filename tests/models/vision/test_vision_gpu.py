"""GPU checks of FastVisionModel (the GPU machine: ``pytest -m gpu tests/models/vision -s``).

The tiny VLMs on CUDA, where the decoder runs the Triton kernels: 10 LoRA steps in bf16 against
transformers + PEFT in bf16 on the same weights, seed and caption batches. bf16 rounding makes both
drift from the exact run, so the yardstick is an fp32 HF+PEFT run: the first step's LoRA gradients
of ours may be no further from it than 3x the bf16 HF+PEFT run's distance (the measured bf16 noise
floor, plus a floor of 1e-3), the per-step losses agree within 2%, and the loss falls. NF4: the same
run with 4-bit bases (bitsandbytes' CUDA kernels for the reference), losses within 2%.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.testing import rel_err

from .conftest import VISION
from .test_vision_parity import _targets, ours, reference, run

pytestmark = pytest.mark.gpu


def _batches(model, processor, caption_rows):
    from notebookkit.data import VisionDataCollator

    collator = VisionDataCollator(model, processor)
    rows = caption_rows(8)
    return [{k: v.cuda() for k, v in collator(rows[i:i + 4]).items()} for i in (0, 4)]


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["bf16", "nf4"])
@pytest.mark.parametrize("family", list(VISION))
def test_bf16_parity_on_gpu(family, load_in_4bit, vlm_folder, caption_rows):
    folder = vlm_folder(family)
    names = _targets(folder, family)
    model, processor = ours(folder, load_in_4bit, dtype=torch.bfloat16)
    assert next(model.parameters()).is_cuda
    batches = _batches(model, processor, caption_rows)
    got = run(model, batches)
    del model
    ref16 = run(reference(folder, family, names, load_in_4bit, torch.bfloat16, device=0), batches)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got[0], ref16[0]))
    assert worst <= 0.02, f"losses differ by {worst:.2%}\nours {got[0]}\nref  {ref16[0]}"
    assert got[0][-1] < got[0][0]
    if load_in_4bit:
        return
    ref32 = run(reference(folder, family, names, False, torch.float32, device=0), batches)
    for name, exact in ref32[1].items():
        if "lora_B" not in name:
            continue
        floor = rel_err(ref16[1][name].float(), exact)
        ours_err = rel_err(got[1][name].float(), exact)
        assert ours_err <= 3 * floor + 1e-3, f"{name}: ours {ours_err:.2e} vs bf16 HF+PEFT {floor:.2e}"
    print(f"\n[vision gpu {family}] bf16 loss gap {worst:.2%}")


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_image_prompts_on_cuda_graphs_equal_hugging_face(vlm_folder, caption_rows, family):
    """Image prompts after for_inference on CUDA (fp32, random LoRA, left padding): the prefill by the model's
    own forward, the decode steps replayed as CUDA graphs (Qwen2.5-VL: at its rope_deltas offsets); greedy ids
    equal to Hugging Face's generate."""
    from notebookkit import FastVisionModel
    from notebookkit.models.generation import generation_state, is_bound

    from .test_vision_decode import _inputs

    torch.manual_seed(0)
    model, processor = FastVisionModel.from_pretrained(vlm_folder(family), max_seq_length=256, dtype=torch.float32,
                                                       load_in_4bit=False, show_banner=False)
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                           show_banner=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    inputs = {k: v.cuda() for k, v in _inputs(processor, caption_rows(4, "eval")).items()}
    model.eval()
    with torch.no_grad():
        reference = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    FastVisionModel.for_inference(model)
    assert is_bound(model)
    fast = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    runner = generation_state(model).runner
    assert runner.captures >= 1 and runner.replays >= 1 and runner.failures == 0
    assert torch.equal(fast, reference), (fast, reference)
