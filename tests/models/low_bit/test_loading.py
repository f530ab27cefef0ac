"""Loading 2-bit and ternary bases: pre-quantised save -> reload, BitNet b1.58 checkpoints, the base
format recorded on the model, and the messages for what cannot be loaded."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from notebookkit.memory.model_setup import base_format_of
from notebookkit.models import FastLanguageModel
from notebookkit.base_layers.low_bit_linear import Q2Linear, TernaryLinear, is_low_bit_linear
from notebookkit.models.low_bit.flags import CONFIG_KEY

from ..helpers import byte_tokenizer
from .common import batch, checkpoint, load


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_prequantised_save_and_reload_is_the_same_model(base_format, tmp_path):
    model, tok = load(checkpoint("qwen2"), base_format)  # qwen2: q/k/v have a bias
    assert base_format_of(model) == base_format
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())[CONFIG_KEY]
    assert saved["format"] == base_format and len(saved["modules"]) == 2 * 7
    again, _ = load(str(tmp_path))  # no flag: the checkpoint says what it is
    assert "loaded as saved" in str(again.notebookkit_banner)
    assert base_format_of(again) == base_format
    want, got = model.state_dict(), again.state_dict()
    assert want.keys() == got.keys()
    different = [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]
    assert not different, different
    ids = batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_the_16bit_and_nf4_loads_record_their_format_too():
    model, _ = load(checkpoint("llama"), load_in_4bit=False)
    assert base_format_of(model) == "16bit" and not any(is_low_bit_linear(m) for m in model.modules())


def test_quantised_on_load_matches_quantising_the_dense_weight():
    """Streaming the checkpoint quantises each projection exactly as quantising the dense layer does."""
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model, _ = load(path, "2bit")
    for name, module in model.named_modules():
        if isinstance(module, Q2Linear):
            want = Q2Linear.from_linear(dense.get_submodule(name))
            assert torch.equal(module.qweight, want.qweight) and torch.equal(module.scale, want.scale)
            assert torch.equal(module.zero, want.zero)
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert torch.equal(model.state_dict()[norm], dense.state_dict()[norm])


def _bitnet_pack(t: torch.Tensor) -> torch.Tensor:
    """transformers' BitNet ``bitlinear`` packing: row ``i * R + r`` in bits ``2i`` of stored row ``r``."""
    o = t.shape[0]
    r = -(-o // 4)
    codes = torch.ones((4 * r, t.shape[1]), dtype=torch.uint8)
    codes[:o] = (t + 1).to(torch.uint8)
    out = torch.zeros((r, t.shape[1]), dtype=torch.uint8)
    for i in range(4):
        out |= codes[i * r:(i + 1) * r] << (2 * i)
    return out


def _bitnet_checkpoint(folder, linear_class: str = "bitlinear", seed: int = 0) -> dict:
    """A tiny BitNet b1.58 checkpoint in transformers' offline layout; returns each projection's dense
    ternary weight ``t / weight_scale`` (what the layer computes with)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.BitNetConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=300, bos_token_id=256, eos_token_id=257)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    tensors, dense = {}, {}
    for name, p in model.state_dict().items():
        owner = name.rsplit(".", 1)[0]
        if owner.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            t = torch.randint(-1, 2, p.shape)
            scale = torch.tensor(float(torch.empty(()).uniform_(20, 60)), dtype=torch.bfloat16)
            tensors[name] = _bitnet_pack(t)
            tensors[owner + ".weight_scale"] = scale.reshape(1)
            dense[owner] = t.float() / scale.float()
        else:
            tensors[name] = p.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg.quantization_config = {"quant_method": "bitnet", "linear_class": linear_class, "quantization_mode": "offline"}
    cfg.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return dense


def test_a_bitnet_checkpoint_loads_as_a_ternary_base(tmp_path):
    dense = _bitnet_checkpoint(tmp_path)
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path), max_seq_length=64, dtype=torch.float32,
                                                 show_banner=False)
    assert base_format_of(model) == "ternary" and "BitNet" in str(model.notebookkit_banner)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, TernaryLinear)}
    assert layers.keys() == dense.keys()
    for name, module in layers.items():
        got = module.dequantized_weight(torch.float32)
        assert torch.allclose(got, dense[name], rtol=1e-3, atol=0), name  # fp16 scale of 1 / weight_scale
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=batch()["input_ids"]).logits).all()


def test_an_unknown_bitnet_layout_says_what_to_do(tmp_path):
    _bitnet_checkpoint(tmp_path, linear_class="bitlinear_v9")
    with pytest.raises(ValueError, match=r"Unknown BitNet layout linear_class='bitlinear_v9'.*quantize_ternary"):
        load(str(tmp_path))


@pytest.mark.parametrize("given, match", [
    ({"load_in_2bit": True, "load_in_ternary": True}, r"two base formats at once\. Pass one of them"),
    ({"load_in_2bit": True, "load_in_4bit": True}, r"Drop load_in_4bit=True .*or drop load_in_2bit=True"),
    ({"load_in_ternary": True, "load_in_8bit": True}, r"Drop load_in_8bit=True"),
    ({"load_in_2bit": True, "full_finetuning": True}, r"Drop full_finetuning=True to train LoRA"),
    ({"load_in_2bit": True, "device_map": "auto"}, r"device_map='auto' spreads it\. Pass device_map=None"),
])
def test_conflicting_requests_say_what_to_change(given, match):
    with pytest.raises(ValueError, match=match):
        FastLanguageModel.from_pretrained(checkpoint("llama"), max_seq_length=64, dtype=torch.float32,
                                          show_banner=False, **given)


def test_a_layer_2bit_cannot_hold_is_named():
    path = checkpoint("llama", intermediate_size=96)  # down_proj reads 96 features: not whole groups of 64
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj has in_features=96.*load_in_ternary=True"):
        load(path, "2bit")
    model, _ = load(path, "ternary")  # ternary serves any width
    assert base_format_of(model) == "ternary"


def test_a_prequantised_checkpoint_refuses_another_format(tmp_path):
    model, tok = load(checkpoint("llama"), "2bit")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"saved pre-quantised in 2-bit.*Drop load_in_ternary=True"):
        load(str(tmp_path), "ternary")


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_a_saved_adapter_reloads_onto_the_low_bit_base(base_format, tmp_path):
    """``save_pretrained`` of the PEFT model writes the adapter; loading the adapter folder with the same
    flag quantises the base again (deterministic fit) and puts the adapter on top: the same logits."""
    from .common import with_lora

    model, tok = load(checkpoint("llama"), base_format)
    model = with_lora(model, seed=5)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, _ = load(str(tmp_path), base_format)
    assert base_format_of(again.get_base_model()) == base_format
    ids = batch()["input_ids"]
    model.eval()
    again.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_merging_lora_into_a_low_bit_base_says_what_to_do_instead():
    import copy

    from notebookkit.models.low_bit.merge_guard import LowBitMergeError

    from .common import with_lora

    model = with_lora(load(checkpoint("llama"), "2bit")[0])
    with pytest.raises(LowBitMergeError, match=r"not possible in place.*load_in_2bit=True\) puts it back"):
        model.merge_and_unload()
    with pytest.raises(LowBitMergeError):
        copy.deepcopy(model).merge_adapter()


def test_the_stream_holds_one_dense_projection_at_a_time_and_reads_shards(monkeypatch, tmp_path):
    """A checkpoint in several safetensors shards loads as the single-file one does, and when a
    projection is quantised no earlier projection's 16-bit weight is still alive (one at a time)."""
    import weakref

    from transformers import AutoModelForCausalLM

    from notebookkit.models.low_bit import stream_load

    path = checkpoint("llama")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(tmp_path, max_shard_size="40KB")
    shards = list(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((__import__("pathlib").Path(path) / name).read_bytes())
    seen, still_alive = [], []
    real = stream_load.quantize_q2

    def watched(weight, group_size):
        still_alive.append(sum(ref() is not None for ref in seen))
        seen.append(weakref.ref(weight))
        return real(weight, group_size)

    monkeypatch.setattr(stream_load, "quantize_q2", watched)
    sharded, _ = load(str(tmp_path), "2bit")
    assert len(seen) == 2 * 7 and still_alive == [0] * len(seen), still_alive
    monkeypatch.undo()
    single, _ = load(path, "2bit")
    want, got = single.state_dict(), sharded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_checkpoint_with_other_tensor_names_says_what_to_do(tmp_path):
    from safetensors.torch import load_file, save_file

    path = checkpoint("llama")
    tensors = {k.replace("model.", "backbone.", 1): v for k, v in load_file(f"{path}/model.safetensors").items()}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((__import__("pathlib").Path(path) / name).read_bytes())
    with pytest.raises(ValueError, match=r"lacks \d+ tensors LlamaForCausalLM needs.*named otherwise \(e\.g\. "
                                         r"backbone\..*load_in_4bit=True or in 16-bit"):
        load(str(tmp_path), "2bit")


def test_a_merged_export_from_a_low_bit_base_loads_back_dense(tmp_path):
    """merged_16bit of a ternary base with LoRA (once refused): a folder without the low-bit record that loads
    back as a 16-bit model computing what the LoRA model computes (written in fp32: to fp32 rounding).
    The merge's arithmetic is tested in tests/export/test_low_bit_bases.py."""
    from .common import with_lora

    model, tok = load(checkpoint("llama"), "ternary")
    model = with_lora(model)
    model.save_pretrained_merged(str(tmp_path), tok, save_method="merged_16bit", dtype=torch.float32, verbose=False)
    assert CONFIG_KEY not in json.loads((tmp_path / "config.json").read_text())
    again, _ = load(str(tmp_path), load_in_4bit=False)
    assert base_format_of(again) == "16bit" and not any(is_low_bit_linear(m) for m in again.modules())
    ids = batch()["input_ids"]
    model.eval()
    again.eval()
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, again(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
