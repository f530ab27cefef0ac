"""``from_pretrained(offload_embedding=True)``: the input embedding table in pinned host memory.

CPU: the keyword's values, the banner's reason when it does not apply (no GPU, a tied or a trainable
embedding, a distributed launch, a device_map over several devices), the mapping helper's refusals, and
the memory model (the table leaves the base weights and joins the host memory; the estimate reads the
mark off a model). GPU (``pytest -m gpu``): the table
really leaves ``torch.cuda.memory_allocated``, the weight stays a CUDA tensor, and the loss, logits and
greedy tokens of the fast decode path (CUDA graphs) are bit-identical to the model before the move (LoRA
gradients within the backward's own run-to-run noise), in bf16 and fp16.
"""

from __future__ import annotations

import copy

import pytest
import torch

from notebookkit.memory import estimate_training_memory
from notebookkit.memory.estimate import estimate_kwargs_from_model
from notebookkit.memory.host_mapped import host_mapped_cuda_tensor
from notebookkit.memory.model_setup import host_embedding, record_host_embedding
from notebookkit.models import FastLanguageModel
from notebookkit.models.common.banner import Banner
from notebookkit.models.loading.offload_embedding import offload_embedding_value, offload_input_embedding

UNTIED = "notebookkit/tiny-mistral"  # untied embeddings, as Llama-3.1-8B and Qwen2.5-7B
TIED = "notebookkit/tiny-llama"  # tied, as Llama 3.2 1B/3B


def _load(name=UNTIED, **kw):
    kw.setdefault("load_in_4bit", False)
    return FastLanguageModel.from_pretrained(name, max_seq_length=64, show_banner=False, **kw)


def test_keyword_values():
    assert offload_embedding_value(True) is True
    assert offload_embedding_value(False) is False and offload_embedding_value(None) is False
    assert offload_embedding_value("auto") is False  # Unsloth's default spelling: left to the user
    with pytest.raises(ValueError, match="offload_embedding='yes' is not True or False"):
        offload_embedding_value("yes")
    with pytest.raises(ValueError, match="offload_embedding='yes'"):
        _load(offload_embedding="yes")


def test_on_a_cpu_the_banner_says_why_nothing_moved():
    model, _ = _load(offload_embedding=True)
    line = model.notebookkit_banner.line("offload_embedding")
    assert line.startswith("[off] offload_embedding") and "not a CUDA GPU: nothing to save" in line
    assert not host_embedding(model.get_input_embeddings())


def test_a_tied_or_trainable_embedding_stays_and_says_so():
    model, _ = _load(TIED)
    banner = Banner()
    assert offload_input_embedding(model, banner) == 0
    assert "tied to the LM head" in banner.line("offload_embedding")
    model, _ = _load(full_finetuning=True)
    banner = Banner()
    assert offload_input_embedding(model, banner) == 0
    assert "trainable (full_finetuning)" in banner.line("offload_embedding")


def test_a_distributed_launch_keeps_the_table_on_each_gpu(monkeypatch):
    model, _ = _load()
    monkeypatch.setenv("WORLD_SIZE", "2")
    banner = Banner()
    assert offload_input_embedding(model, banner) == 0
    assert "distributed launch (WORLD_SIZE=2)" in banner.line("offload_embedding")


def test_a_model_spread_by_device_map_keeps_its_table():
    """A ``device_map`` that places modules on several devices is refused, and says so (checked before the
    device, so the CPU run sees this reason); a map with every module on one device is not a reason."""
    model, _ = _load()
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 1, "lm_head": 1}
    banner = Banner()
    assert offload_input_embedding(model, banner) == 0
    assert "device_map spreads the model over several devices" in banner.line("offload_embedding")
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 0, "model.norm": 0, "lm_head": 0}
    banner = Banner()
    assert offload_input_embedding(model, banner) == 0
    assert "not a CUDA GPU" in banner.line("offload_embedding")


def test_the_mapping_helper_refuses_what_it_cannot_map():
    with pytest.raises(ValueError, match="not a CUDA device"):
        host_mapped_cuda_tensor(torch.zeros(4), torch.device("cpu"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="must be pinned"):
            host_mapped_cuda_tensor(torch.zeros(4), torch.device("cuda"))


def test_the_memory_model_moves_an_untied_table_to_the_host():
    kw = dict(load_in_4bit=True, batch_size=2, seq_len=1024, activation_plan="offload", method="dpo")
    name = "meta-llama/Llama-3.1-8B-Instruct"
    on_gpu = estimate_training_memory(name, **kw)
    on_host = estimate_training_memory(name, offload_embedding=True, **kw)
    table = 128256 * 4096 * 2  # V x H in bf16: 0.98 GiB
    assert on_gpu.base_weights - on_host.base_weights == table == on_gpu.total - on_host.total
    assert on_host.host_offload - on_gpu.host_offload == 2**30  # a pinned block: rounded up to a power of two
    assert on_host.inputs["offload_embedding"] is True and on_gpu.inputs["offload_embedding"] is False
    tied = "meta-llama/Llama-3.2-1B-Instruct"
    assert estimate_training_memory(tied, offload_embedding=True).total == estimate_training_memory(tied).total


def test_the_estimate_reads_the_mark_off_a_model():
    model, _ = _load()
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    assert "offload_embedding" not in estimate_kwargs_from_model(model)
    record_host_embedding(model.get_input_embeddings(), True)  # what offload_input_embedding leaves on a GPU
    assert estimate_kwargs_from_model(model)["offload_embedding"] is True
    copied = copy.deepcopy(model.get_input_embeddings())  # the mark travels, the table is new memory
    assert not host_embedding(copied)
    model.get_input_embeddings().weight.requires_grad_(True)  # a trained table is on the GPU (PEFT's copy)
    assert "offload_embedding" not in estimate_kwargs_from_model(model)


# ---------------------------------------------------------------------------------------------- GPU

def _batch(model, rows=2, length=37):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=generator).to("cuda")
    return ids


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_the_table_leaves_gpu_memory_and_nothing_else_changes(dtype):
    from notebookkit.memory.host_mapped import is_host_mapped

    model, tok = _load(dtype=dtype)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, random_state=0, show_banner=False)
    for name, p in model.named_parameters():  # non-zero B: the adapters take part in the comparison
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids = _batch(model)
    labels = ids.clone()

    def logits_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        return out.loss.detach(), logits, grads

    def greedy():
        FastLanguageModel.for_inference(model)
        prompt = ids[:, :9]
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        FastLanguageModel.for_training(model)
        return out

    before = logits_and_grads()
    tokens = greedy()
    embed = model.get_input_embeddings()
    table = embed.weight.numel() * embed.weight.element_size()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    freed = offload_input_embedding(model.get_base_model())
    torch.cuda.synchronize()
    assert freed == table and allocated - torch.cuda.memory_allocated() >= table
    assert embed.weight.device.type == "cuda" and model.device.type == "cuda" and is_host_mapped(embed.weight)
    assert estimate_kwargs_from_model(model)["offload_embedding"] is True
    from notebookkit.models.generation.state import release

    release(model)  # a fresh plan and fresh graphs read the moved table
    after = logits_and_grads()
    again = logits_and_grads()  # the same step twice: the run-to-run noise of the backward's reductions
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])  # the forward reads equal rows
    assert before[2].keys() == after[2].keys()
    for name, grad in before[2].items():
        noise = (again[2][name] - after[2][name]).abs().max()
        assert (after[2][name] - grad).abs().max() <= 2 * noise + 1e-6, name
    assert torch.equal(tokens, greedy())


@pytest.mark.gpu
def test_gpu_from_pretrained_reports_the_saving():
    model, _ = _load(dtype=torch.bfloat16, offload_embedding=True)
    line = model.notebookkit_banner.line("offload_embedding")
    assert line.startswith("[on ] offload_embedding") and "pinned host memory" in line
    assert host_embedding(model.get_input_embeddings())
