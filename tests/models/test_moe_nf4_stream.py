"""The streamed NF4 load of a mixture of experts' stacked expert weights (``load_in_4bit=True``):
``notebookkit.models.loading.stream_nf4_experts`` quantises each as transformers reads it.

* Same model as quantising after the load (the previous path, got here by switching the stream off): every NF4
  expert weight's codes, absmax codes, second-level scales, offset and tables, every other tensor of the state
  dict (bitsandbytes' 4-bit linears as transformers makes them) bit for bit, and the same logits; the banner
  says which path ran. Both families' embedded tiny defaults: Qwen3-MoE's checkpoint holds per-expert tensors
  (``experts.{e}.gate_proj.weight``, stacked by transformers' conversion as it loads), gpt-oss's the stacked ones.
* The 16-bit experts never all exist: a small model of each family with 6 layers of 16 experts (12 stacked
  weights), loaded with a spy that sees every loaded stacked weight as it is registered (before the stream
  quantises it) and counts, each time, how many loaded 16-bit stacked weights are still alive (weak references,
  after a garbage collection): at most one, and none after the load. Quantising after the load, all 12 are.
* GPU (``-m gpu``): the same small models on the GPU in fp16, where the device's allocated bytes, sampled at each
  registration, stay within the NF4 model plus one 16-bit stacked weight (quantising after the load: all of them).
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")

import notebookkit.models.loading.loader as loader  # noqa: E402
from notebookkit.base_layers.nf4_experts import NF4ExpertParam  # noqa: E402
from notebookkit.families import FAMILIES as FAMILY_RECORDS  # noqa: E402
from notebookkit.models import FastLanguageModel  # noqa: E402
from notebookkit.models.loading.stream_nf4_experts import STACKED, ExpertTally  # noqa: E402

from .helpers import MOE_FAMILIES, tiny_folder  # noqa: E402

LAYERS, EXPERTS = 6, 16


@contextlib.contextmanager
def _no_stream(tally: ExpertTally):
    yield tally


@pytest.fixture
def quantise_after_the_load(monkeypatch):
    """The loader without the stream: every stacked expert weight loads in 16 bits, then goes to NF4."""
    monkeypatch.setattr(loader, "quantize_experts_as_read", _no_stream)


def _load(path, dtype=torch.float32):
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=64, dtype=dtype, load_in_4bit=True,
                                                 show_banner=False)
    return model


def _expert_params(model):
    return {f"{i}.{name}": getattr(layer.mlp.experts, name)
            for i, layer in enumerate(model.model.layers) for name in STACKED}


def _nf4_tensors(p: NF4ExpertParam) -> dict:
    q = p.quant_state
    return {"codes": p.data, "absmax": q.absmax, "offset": q.offset, "code": q.code, "absmax2": q.state2.absmax,
            "code2": q.state2.code}


def _logits(model, vocab):
    ids = torch.randint(3, vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_streamed_experts_equal_quantising_after_the_load(family, monkeypatch, one_thread):
    streamed = _load(tiny_folder(family))
    assert "each quantised as it was read" in streamed.notebookkit_banner.line("NF4 experts")
    with monkeypatch.context() as m:
        m.setattr(loader, "quantize_experts_as_read", _no_stream)
        after = _load(tiny_folder(family))
    assert "quantised after the load" in after.notebookkit_banner.line("NF4 experts")

    ours, theirs = _expert_params(streamed), _expert_params(after)
    assert ours.keys() == theirs.keys() and len(ours) == 2 * streamed.config.num_hidden_layers
    for key, p in ours.items():
        q = theirs[key]
        assert isinstance(p, NF4ExpertParam) and isinstance(q, NF4ExpertParam), key
        assert p.ds_shape == q.ds_shape and p.quant_state.dtype == q.quant_state.dtype, key
        assert not p.requires_grad
        for part, t in _nf4_tensors(p).items():
            u = _nf4_tensors(q)[part]
            assert t.dtype == u.dtype and torch.equal(t, u), (key, part)
    ours_sd, theirs_sd = streamed.state_dict(), after.state_dict()
    assert ours_sd.keys() == theirs_sd.keys()
    for key, t in ours_sd.items():
        assert t.dtype == theirs_sd[key].dtype and torch.equal(t, theirs_sd[key]), key
    assert any(type(m).__name__ == "Linear4bit" for m in streamed.modules())  # bitsandbytes' own linears
    vocab = streamed.config.vocab_size
    assert torch.equal(_logits(streamed, vocab), _logits(after, vocab))


class LiveExpertWeights:
    """A parameter-registration spy (registered before the loader's stream, so it sees each loaded stacked
    expert weight in 16 bits): how many it saw, and the most of them alive at once. ``sample`` (optional)
    is called at each such registration, e.g. to read the device's allocated bytes."""

    def __init__(self, sample=None):
        self.refs: list[weakref.ref] = []
        self.most_alive = 0
        self.samples: list[int] = []
        self.sample = sample

    def alive(self) -> int:
        gc.collect()  # a 16-bit weight kept only by a reference cycle would still be freed by now
        return sum(r() is not None for r in self.refs)

    def __call__(self, module, name, param):
        if name in STACKED and param.dim() == 3 and param.is_floating_point() and not param.is_meta:
            self.refs.append(weakref.ref(param))
            self.most_alive = max(self.most_alive, self.alive())
            if self.sample is not None:
                self.samples.append(self.sample())

    @contextlib.contextmanager
    def watching(self):
        handle = torch.nn.modules.module.register_module_parameter_registration_hook(self)
        try:
            yield self
        finally:
            handle.remove()


def _many_experts_folder(family, root) -> str:
    """``family``'s tiny model with :data:`LAYERS` layers of :data:`EXPERTS` experts, random, saved by
    transformers (Qwen3-MoE: per-expert tensors; gpt-oss: stacked), with the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = tiny_folder(family)
    config = AutoConfig.from_pretrained(tiny)
    config.num_hidden_layers = LAYERS
    setattr(config, FAMILY_RECORDS[family].moe.num_experts, EXPERTS)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(LAYERS)]
    torch.manual_seed(0)
    folder = root / family
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (p := Path(tiny) / f).is_file():
            shutil.copy(p, folder / f)
    return str(folder)


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    root = tmp_path_factory.mktemp("many-experts")
    yield {family: _many_experts_folder(family, root) for family in MOE_FAMILIES}
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_16bit_experts_never_all_exist(family, many_experts, one_thread):
    spy = LiveExpertWeights()
    with spy.watching():
        model = _load(many_experts[family])
    assert len(spy.refs) == 2 * LAYERS, "the spy saw every stacked expert weight load"
    assert model.model.layers[0].mlp.experts.gate_up_proj.ds_shape[0] == EXPERTS
    assert spy.most_alive == 1, (f"{spy.most_alive} of the {2 * LAYERS} 16-bit stacked expert weights were alive "
                                 "at once during the load")
    assert spy.alive() == 0
    assert all(isinstance(p, NF4ExpertParam) for p in _expert_params(model).values())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_spy_sees_all_16bit_experts_alive_without_the_stream(family, many_experts, quantise_after_the_load,
                                                                  one_thread):
    """The previous test's measure, on the path that does hold them all: it would see a stream that leaked."""
    spy = LiveExpertWeights()
    with spy.watching():
        _load(many_experts[family])
    assert spy.most_alive == 2 * LAYERS


def _stacked_bytes(path, dtype) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    moe = FAMILY_RECORDS[config.model_type].moe
    E, H, I = getattr(config, moe.num_experts), config.hidden_size, getattr(config, moe.intermediate)
    return 2 * E * H * I * dtype.itemsize  # gate_up_proj, the larger of the two


@pytest.mark.gpu
@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_device_bytes_during_the_streamed_load(family, streamed, many_experts, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not streamed:
        monkeypatch.setattr(loader, "quantize_experts_as_read", _no_stream)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    spy = LiveExpertWeights(sample=torch.cuda.memory_allocated)
    with spy.watching():
        model = _load(many_experts[family], dtype=torch.float16)
    held = torch.cuda.memory_allocated() - base  # the NF4 model
    one = _stacked_bytes(many_experts[family], torch.float16)  # a 16-bit gate_up_proj; down_proj is half
    most = max(spy.samples) - base
    if streamed:  # the model so far, the incoming weight, and (per-expert checkpoints) its pieces
        assert most <= held + 2 * one, (most, held, one)
    else:  # every 16-bit stacked weight (LAYERS * 1.5 one) alive at the last registration
        assert most >= LAYERS * one * 3 // 2, (most, held, one)
    del model
