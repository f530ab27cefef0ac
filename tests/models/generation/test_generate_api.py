"""``model.generate`` as a notebook user meets it: binding by for_inference / for_training, Hugging
Face's call forms, the fall-back to Hugging Face's generate (and its one-time warning), bad input with
the message that says what to change, the streamer, the static cache's life, and that training after
generation is exactly training before it."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, TextStreamer, TopKLogitsWarper
from transformers.generation.utils import GenerationMixin

from notebookkit.models import FastLanguageModel
from notebookkit.models.generation import bind_generate, generation_state, is_bound, release

from .common import PAD, fast_copy, left_padded_prompts, lora_model

TINY = "notebookkit/tiny-llama"


def _tiny(max_seq_length=64, **kw):
    model, tokenizer = FastLanguageModel.from_pretrained(TINY, max_seq_length=max_seq_length, load_in_4bit=False,
                                                         show_banner=False)
    return FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False, **kw), tokenizer


def _greedy(**kw):
    return dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, **kw)


@pytest.fixture(scope="module")
def pair():
    stock = lora_model("llama")
    return stock, fast_copy(stock)


# ------------------------------------------------------------------------------------------ binding


def test_for_inference_binds_and_for_training_unbinds_keeping_the_cache():
    model, tokenizer = _tiny()
    assert not is_bound(model)
    FastLanguageModel.for_inference(model)
    causal_lm = model.get_base_model()
    assert is_bound(model) and causal_lm.generate.__self__ is causal_lm
    assert "[on ] fast generation" in str(model.notebookkit_banner)
    ids = tokenizer("The baker", return_tensors="pt")
    model.generate(**ids, max_new_tokens=4)
    cache = generation_state(model).cache
    assert cache is not None and cache.nbytes > 0
    FastLanguageModel.for_training(model)
    assert not is_bound(model) and causal_lm.generate.__func__ is GenerationMixin.generate
    assert generation_state(model).cache is cache  # kept for the next for_inference (GRPO switches each step)
    FastLanguageModel.for_inference(model)
    model.generate(**ids, max_new_tokens=4)
    assert generation_state(model).cache is cache
    release(model)
    assert generation_state(model).cache is None and cache.nbytes == 0


def test_release_returns_the_bytes_it_freed():
    model, tokenizer = _tiny()
    FastLanguageModel.for_inference(model)
    model.generate(**tokenizer("The baker", return_tensors="pt"), max_new_tokens=4)
    held = generation_state(model).cache.nbytes
    assert held > 0 and release(model) == held and release(model) == 0


def test_unknown_family_keeps_hugging_faces_generate():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert bind_generate(model) is False and "generate" not in model.__dict__
    assert "not in notebookkit's family table" in generation_state(model).plan


def test_training_after_generation_is_training_before_it():
    """Loss and every LoRA gradient of a training step: bit for bit the same before for_inference and
    after for_inference -> generate -> for_training."""
    model, tokenizer = _tiny()
    batch = tokenizer(["The baker lives by the river.", "A young owl is called an owlet, the book says."],
                      return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    loss_before, grads_before = step()
    FastLanguageModel.for_inference(model)
    tokenizer.padding_side = "left"
    model.generate(**tokenizer(["The baker", "Owls"], return_tensors="pt", padding=True), max_new_tokens=6)
    FastLanguageModel.for_training(model)
    loss_after, grads_after = step()
    assert len(grads_before) == 2 * 7 * 4
    assert torch.equal(loss_after, loss_before)
    assert grads_after.keys() == grads_before.keys()
    assert all(torch.equal(grads_after[n], grads_before[n]) for n in grads_before)


# ------------------------------------------------------------------------------- Hugging Face's calls


def test_call_forms_give_hugging_faces_ids(pair):
    stock, fast = pair
    ids, mask = left_padded_prompts()
    want = stock.generate(input_ids=ids, attention_mask=mask, **_greedy())
    assert torch.equal(fast.generate(ids, attention_mask=mask, **_greedy()), want)  # inputs positional
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=PAD)  # TRL's way
    assert torch.equal(fast.generate(input_ids=ids, attention_mask=mask, generation_config=config), want)
    # No attention_mask: Hugging Face infers it from the pad id in the prompt, so must we.
    assert torch.equal(fast.generate(input_ids=ids, **_greedy()), stock.generate(input_ids=ids, **_greedy()))
    one = ids[:1]
    assert torch.equal(fast.generate(input_ids=one, max_new_tokens=1, do_sample=False),
                       stock.generate(input_ids=one, max_new_tokens=1, do_sample=False))


def test_the_fast_path_also_runs_a_model_left_on_stock_modules():
    """Norms, MLPs and projections are called as the model has them: patched or Hugging Face's own."""
    stock = lora_model("gemma3")
    plain = copy.deepcopy(stock)
    assert bind_generate(plain)
    ids, mask = left_padded_prompts()
    assert torch.equal(plain.generate(input_ids=ids, attention_mask=mask, **_greedy()),
                       stock.generate(input_ids=ids, attention_mask=mask, **_greedy()))


def test_streamer_prints_what_hugging_faces_prints(capsys):
    model, tokenizer = _tiny()
    reference = copy.deepcopy(model)
    FastLanguageModel.unpatch(reference)
    reference.eval()
    FastLanguageModel.for_inference(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Where does the baker live?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    kw = dict(max_new_tokens=12, do_sample=False)
    want = reference.generate(**prompt, streamer=TextStreamer(tokenizer, skip_prompt=True), **kw)
    printed_hf = capsys.readouterr().out
    got = model.generate(**prompt, streamer=TextStreamer(tokenizer, skip_prompt=True), **kw)
    printed = capsys.readouterr().out
    assert torch.equal(got, want) and printed == printed_hf and printed.strip()


# -------------------------------------------------------------------------------------- fall-backs


def _record(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [str(w.message) for w in caught if "Hugging Face's generate" in str(w.message)]


@pytest.mark.parametrize("extra,reason", [
    (dict(num_beams=2), "the generation mode is 'beam_search'"),
    (dict(suppress_tokens=[3]), "suppress_tokens=[3] is set"),
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size=2 is set"),
])
def test_unsupported_settings_run_hugging_faces_generate_and_say_why_once(extra, reason):
    stock = lora_model("llama")
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts()
    want = stock.generate(input_ids=ids, attention_mask=mask, **_greedy(**extra))
    got, said = _record(lambda: fast.generate(input_ids=ids, attention_mask=mask, **_greedy(**extra)))
    assert torch.equal(got, want)
    assert len(said) == 1 and reason in said[0] and said[0].startswith("model.generate runs Hugging Face's generate")
    _, again = _record(lambda: fast.generate(input_ids=ids, attention_mask=mask, **_greedy(**extra)))
    assert again == []  # once per model and reason


def test_output_dicts_and_logits_processors_run_hugging_faces_generate(pair):
    stock, fast = pair
    ids, mask = left_padded_prompts()
    kw = _greedy(output_scores=True, return_dict_in_generate=True)
    out, said = _record(lambda: fast.generate(input_ids=ids, attention_mask=mask, **kw))
    assert torch.equal(out.sequences, stock.generate(input_ids=ids, attention_mask=mask, **kw).sequences)
    assert said and "output_scores=True is set" in said[0]
    processors = LogitsProcessorList([TopKLogitsWarper(5)])
    _, said = _record(lambda: fast.generate(input_ids=ids, attention_mask=mask, logits_processor=processors, **_greedy()))
    assert said and "logits_processor was passed" in said[0]


def test_a_model_in_training_mode_says_to_call_for_inference():
    stock = lora_model("llama")
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts()
    want = stock.generate(input_ids=ids, attention_mask=mask, **_greedy())
    fast.train()
    got, said = _record(lambda: fast.generate(input_ids=ids, attention_mask=mask, **_greedy()))
    assert torch.equal(got, want)  # no dropout in this model: Hugging Face's greedy tokens are the same
    assert said and "the model is in training mode; call FastLanguageModel.for_inference(model)" in said[0]


# ------------------------------------------------------------------------------------------ bad input


def test_right_padding_is_refused_with_the_fix(pair):
    _, fast = pair
    ids, mask = left_padded_prompts()
    with pytest.raises(ValueError) as info:
        fast.generate(input_ids=ids, attention_mask=mask.flip(1), **_greedy())
    text = str(info.value)
    assert "Row 1 of the batch is padded on the right" in text and 'tokenizer.padding_side = "left"' in text


def test_masks_with_gaps_or_empty_rows_are_refused(pair):
    _, fast = pair
    ids, mask = left_padded_prompts()
    holed = mask.clone()
    holed[0, 5] = 0
    with pytest.raises(ValueError, match="Row 0 of attention_mask has zeros between ones"):
        fast.generate(input_ids=ids, attention_mask=holed, **_greedy())
    empty = mask.clone()
    empty[2] = 0
    with pytest.raises(ValueError, match="Row 2 of attention_mask is all zeros"):
        fast.generate(input_ids=ids, attention_mask=empty, **_greedy())


def test_max_new_tokens_beyond_max_seq_length_is_refused_with_the_fix():
    model, tokenizer = _tiny(max_seq_length=32)
    FastLanguageModel.for_inference(model)
    ids = torch.randint(20, 2000, (1, 11), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as info:
        model.generate(input_ids=ids, max_new_tokens=30)
    text = str(info.value)
    assert "max_new_tokens=30 after a prompt of 11 tokens needs 41 positions, more than max_seq_length=32" in text
    assert "Lower max_new_tokens to 21 or less" in text and "max_seq_length=41" in text
    out = model.generate(input_ids=ids, max_new_tokens=21)  # exactly at the limit: fits
    assert 11 < out.shape[1] <= 32


# ------------------------------------------------------------------------------ the cache's life


def test_cache_is_reused_when_it_fits_and_grows_for_a_larger_batch():
    stock = lora_model("qwen2")
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts()
    fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    state = generation_state(fast)
    first = state.cache
    assert (first.batch, first.capacity) == (3, 256)  # 11 + 8 = 19 slots, rounded up to a multiple of 256
    fast.generate(input_ids=ids[:2], attention_mask=mask[:2], **_greedy())
    assert state.cache is first
    big_ids, big_mask = left_padded_prompts(seed=1, pad_lengths=(0, 1, 2, 5, 9))
    got = fast.generate(input_ids=big_ids, attention_mask=big_mask, **_greedy())
    assert torch.equal(got, stock.generate(input_ids=big_ids, attention_mask=big_mask, **_greedy()))
    assert state.cache is not first and state.cache.batch == 5 and first.nbytes == 0


def test_a_call_after_drop_cache_runs_one_decode_graph_for_its_whole_request(pair, monkeypatch):
    """GRPO with memory short frees the cache after each generation (drop_cache): the next call, whose graphs
    would not outlive it, runs one decode step shape (one graph on CUDA) for the whole request instead of one a
    cache-length bucket, with the same tokens; a call that finds its cache kept uses the buckets again."""
    from notebookkit.models.generation.state import drop_cache

    _, fast = pair
    state = generation_state(fast)
    lengths = []
    run = state.runner.run
    monkeypatch.setattr(state.runner, "run", lambda key, *a: lengths.append(key[1]) or run(key, *a))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))

    def call():
        lengths.clear()
        out = fast.generate(input_ids=ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=PAD)
        return out, sorted(set(lengths))

    def dropped_and_unreferenced() -> bool:  # the cache freed, nothing left holding its tensors (no collector run)
        keys = weakref.ref(generation_state(fast).cache.keys[0])
        enabled = gc.isenabled()
        gc.disable()
        try:
            drop_cache(fast)
            return generation_state(fast).cache is None and keys() is None
        finally:
            if enabled:
                gc.enable()

    release(fast)
    bucketed, buckets = call()
    assert buckets == [16, 32, 64]  # the power-of-two buckets up to 11 + 30 = 41 slots (the cache has 256)
    for _ in range(2):  # GRPO's loop: free the cache (the bucketed call's, then the whole-request call's), generate
        assert dropped_and_unreferenced()
        single, one = call()
        assert one == [48] and torch.equal(single, bucketed)  # 11 + 30 slots, rounded up to 16
    kept, again = call()
    assert again == buckets and torch.equal(kept, bucketed)


def test_del_model_after_generation_frees_it_without_the_cycle_collector():
    fast = fast_copy(lora_model("gemma2"))
    ids, mask = left_padded_prompts()
    fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    keys = weakref.ref(generation_state(fast).cache.keys[0])
    embeddings = weakref.ref(fast.get_input_embeddings().weight)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del fast
        assert embeddings() is None and keys() is None, "the model is kept alive by a reference cycle"
    finally:
        if enabled:
            gc.enable()


def test_a_deep_copy_gets_its_own_generate_and_no_state(pair):
    stock, fast = pair
    ids, mask = left_padded_prompts()
    fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    twin = copy.deepcopy(fast)
    assert generation_state(twin).cache is None
    assert twin.get_base_model().generate.__self__ is twin.get_base_model()
    assert torch.equal(twin.generate(input_ids=ids, attention_mask=mask, **_greedy()),
                       stock.generate(input_ids=ids, attention_mask=mask, **_greedy()))


def test_weights_changed_in_place_are_read_by_the_next_generation():
    """The captured step reads parameters in place (GRPO trains between generations): an in-place
    update of the adapters changes the next tokens exactly as it changes Hugging Face's."""
    stock = lora_model("llama")
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts()
    fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    with torch.no_grad():
        for model in (stock, fast):
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-3.0)
    want = stock.generate(input_ids=ids, attention_mask=mask, **_greedy())
    assert torch.equal(fast.generate(input_ids=ids, attention_mask=mask, **_greedy()), want)
    with fast.disable_adapter(), stock.disable_adapter():  # adapters off: a new plan, the base model's tokens
        want = stock.generate(input_ids=ids, attention_mask=mask, **_greedy())
        assert torch.equal(fast.generate(input_ids=ids, attention_mask=mask, **_greedy()), want)


def test_the_lora_views_are_built_once_and_again_only_when_the_model_changes(monkeypatch):
    """A generate call reads every projection's LoRA view in its prefill; they are kept from call to call while the
    model's signature holds (an 8B model: about 160 builds a call, ~15 ms of host time) and built again when it
    changes (adapters disabled, parameters replaced)."""
    from notebookkit.models.generation.state import model_signature
    from notebookkit.models.patching import lora_fast_path

    built = []
    build = lora_fast_path._build_views
    monkeypatch.setattr(lora_fast_path, "_build_views", lambda modules, training: built.append(modules) or
                        build(modules, training))
    model, _ = _tiny()
    FastLanguageModel.for_inference(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    model.generate(input_ids=ids, **_greedy())
    first = len(built)
    assert first > 0
    model.generate(input_ids=ids, **_greedy())
    assert len(built) == first  # none built again
    causal = model.get_base_model()
    signature = model_signature(causal)
    assert model_signature(causal) == signature
    with model.disable_adapter():
        assert model_signature(causal) != signature
        model.generate(input_ids=ids, **_greedy())
        assert len(built) > first
    lora = next(m for m in causal.modules() if hasattr(m, "lora_A"))
    lora.scaling["default"] *= 2  # an adapter's scaling
    assert model_signature(causal) != signature
    lora.scaling["default"] /= 2
    assert model_signature(causal) == signature
    weight = lora.base_layer.weight
    weight.data = weight.data.clone()  # new storage
    assert model_signature(causal) != signature


def test_fp32_adapters_of_a_16_bit_model_are_cast_once_and_recast_after_an_update():
    """PEFT keeps adapters in fp32 next to 16-bit weights: the decode path keeps one bf16 cast of each and
    each group's A_cat (the captured steps read them) and re-casts, in place, those an optimizer step changed."""
    fast = fast_copy(lora_model("llama")).to(torch.bfloat16)
    for name, p in fast.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    ids, mask = left_padded_prompts()
    before = fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    casts = generation_state(fast).casts
    assert len(casts) == 2 * 7 * 2 + 2 * 2  # A and B of 7 projections, and the A_cat of q/k/v and gate/up, in 2 layers
    kept = [entry[2] for entry in casts._kept.values()]
    joined = [entry[2] for entry in casts._joined.values()]
    with torch.no_grad():
        for name, p in fast.named_parameters():
            if "lora_B" in name:
                p.mul_(-4.0)
            if "lora_A" in name:  # the groups' A_cat too
                p.mul_(1.5)
    after = fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    assert all(entry[2] is old for entry, old in zip(casts._kept.values(), kept))  # same buffers, new values
    assert all(entry[2] is old for entry, old in zip(casts._joined.values(), joined))
    fresh = copy.deepcopy(fast)  # no state: casts made anew from the updated adapters
    assert torch.equal(after, fresh.generate(input_ids=ids, attention_mask=mask, **_greedy()))
    assert not torch.equal(after, before)


def test_casts_follow_an_optimizer_that_writes_through_its_own_kernels():
    """bitsandbytes' 8-bit AdamW (the notebooks' optimizer on a GPU) updates the parameters in its own kernels,
    which do not move their version counters. GRPO on a T4 trains fp32 adapters under fp16 weights and
    generates between steps: the next generate must read the updated adapters, not the casts of the first
    call (it sampled from the policy of the first step for the whole run)."""
    import bitsandbytes as bnb

    fast = fast_copy(lora_model("llama")).to(torch.bfloat16)
    adapters = []
    for name, p in fast.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            adapters.append(p)
    ids, mask = left_padded_prompts()
    before = fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    optimizer = bnb.optim.AdamW8bit(adapters, lr=0.5, min_8bit_size=1)
    for p in adapters:
        p.grad = torch.randn_like(p)
    versions = [p._version for p in adapters]
    optimizer.step()
    assert [p._version for p in adapters] == versions  # the counters did not move: only a re-cast sees it
    after = fast.generate(input_ids=ids, attention_mask=mask, **_greedy())
    fresh = copy.deepcopy(fast)
    assert torch.equal(after, fresh.generate(input_ids=ids, attention_mask=mask, **_greedy()))
    assert not torch.equal(after, before)


def test_sampling_runs_on_the_fast_path_and_follows_the_seed(pair):
    _, fast = pair
    ids, mask = left_padded_prompts()
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20, pad_token_id=PAD)
    _, said = _record(lambda: fast.generate(input_ids=ids, attention_mask=mask, **kw))
    assert said == []
    torch.manual_seed(7)
    a = fast.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.manual_seed(7)
    b = fast.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.manual_seed(8)
    c = fast.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c) and a.shape == (3, 21)
