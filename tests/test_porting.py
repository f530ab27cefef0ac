"""Porting is a change of import: every name of the README's porting table imports from its notebookkit
path, the names notebookkit does not provide say what to use instead, and the cells of the two most
used SFT notebooks (Alpaca; conversational with train_on_responses_only) run on the tiny default with
only their imports changed.

The cells below follow those notebooks line by line. Besides the imports, only what cannot run
here differs, each marked ``# here:``: the model and data set names (the tiny default and the
bundled copies of the same layouts, read through the same ``load_dataset``), two optimizer steps
instead of 60, ``use_cpu=True`` where TRL asks for it without a GPU, the device of ``.to("cuda")``,
and ``return_dict=False`` for ``apply_chat_template`` (transformers 5 returns a dict there).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

README = Path(__file__).resolve().parents[1] / "README.md"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_CPU = not torch.cuda.is_available()


def _porting_rows() -> list[tuple[str, str]]:
    """(other notebooks' code, notebookkit's code) for each row of the README's porting table."""
    text = README.read_text()
    section = text[text.index("## Porting a notebook"):]
    section = section[: section.find("\n## ", 3)] if "\n## " in section[3:] else section
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows.append((cells[0], cells[1]))
    return rows


def test_every_import_of_the_porting_table_works():
    imports = [m.group(1) for _, ours in _porting_rows() for m in re.finditer(r"`(from notebookkit[\w.]* import [^`]+)`", ours)]
    assert len(imports) >= 8, imports
    for statement in imports:
        names = [n.strip().split(" as ")[-1] for n in statement.split(" import ", 1)[1].split(",")]
        scope: dict = {}
        exec(statement, scope)  # noqa: S102 - the README's own lines
        for name in names:
            assert scope[name] is not None, statement


def test_the_chat_helpers_are_the_same_objects_under_both_paths():
    import notebookkit
    import notebookkit.chat_templates as ported
    import notebookkit.data as data

    for name in ("get_chat_template", "train_on_responses_only", "standardize_sharegpt", "standardize_data_formats"):
        assert getattr(ported, name) is getattr(data, name) is getattr(notebookkit, name)


def test_names_not_provided_say_what_to_use_and_are_in_the_table():
    from notebookkit._porting import CHAT_TEMPLATES_MODULE, TOP_LEVEL, NotProvidedError

    ported_from = " ".join(theirs for theirs, _ in _porting_rows())
    for module, table in (("notebookkit", TOP_LEVEL), ("notebookkit.chat_templates", CHAT_TEMPLATES_MODULE)):
        for name, advice in table.items():
            with pytest.raises(NotProvidedError) as info:
                exec(f"from {module} import {name}", {})  # noqa: S102
            assert str(info.value) == f"{module} has no {name}: {advice}"
            assert name in ported_from, f"{name} is missing from the README's porting table"
    with pytest.raises(NotProvidedError, match="use notebookkit.data.VisionDataCollator"):
        exec("from notebookkit import UnslothVisionDataCollator", {})  # noqa: S102
    scope: dict = {}
    exec("from notebookkit import FastVisionModel", scope)  # noqa: S102 - provided since issue #23
    assert scope["FastVisionModel"].__name__ == "FastVisionModel"
    with pytest.raises(ImportError, match="cannot import name 'NoSuchName'"):
        exec("from notebookkit import NoSuchName", {})  # noqa: S102


def test_standardize_data_formats_means_what_the_notebooks_mean():
    from datasets import Dataset

    from notebookkit.chat_templates import standardize_data_formats

    rows = [{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "A"}], "score": 1.0}]
    out = standardize_data_formats(Dataset.from_list(rows))
    assert out.column_names == ["conversations", "score"]
    assert out[0]["conversations"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    ]
    renamed = standardize_data_formats(Dataset.from_list(rows), aliases_for_user=["human"], aliases_for_assistant=["gpt"])
    assert renamed[0]["conversations"][2]["role"] == "assistant"
    with pytest.raises(ValueError, match="unknown role 'human'.*the role aliases you passed"):
        standardize_data_formats(Dataset.from_list(rows), aliases_for_user=["user"])
    plain = Dataset.from_list([{"text": "a"}])
    assert standardize_data_formats(plain) is plain


def test_standardize_data_formats_sends_vision_rows_to_the_collator():
    from datasets import Dataset

    from notebookkit.chat_templates import standardize_data_formats

    class Processor:
        image_processor = object()

    with pytest.raises(NotImplementedError, match="VisionDataCollator") as info:
        standardize_data_formats(Dataset.from_list([{"text": "a"}]), tokenizer=Processor())
    assert "issue" not in str(info.value) and "yet" not in str(info.value)  # vision fine-tuning ships


def test_get_chat_template_refuses_what_it_cannot_mean(tmp_path):
    from notebookkit.chat_templates import get_chat_template
    from notebookkit.embedded.tiny import resolve_model_name
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_name("notebookkit/tiny-llama")))
    sharegpt = {"role": "from", "content": "value", "user": "human", "assistant": "gpt"}
    with pytest.raises(TypeError, match=r"mapping=.*standardize_sharegpt\(dataset\) rewrites from/value turns"):
        get_chat_template(tokenizer, chat_template="chatml", mapping=sharegpt)
    identity = {"role": "role", "content": "content", "user": "user", "assistant": "assistant"}
    assert get_chat_template(tokenizer, chat_template="llama-3.1", mapping=identity) is tokenizer
    with pytest.raises(TypeError, match=r"a \(jinja template, EOS token\) pair is not supported"):
        get_chat_template(tokenizer, chat_template=("{{ messages }}", "</s>"))


@pytest.fixture
def one_thread_cells(one_thread, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the notebooks write "outputs" and "lora_model" next to themselves
    return tmp_path


def _first_two_cells():
    """The first two cells, the same in both notebooks: load the model, add LoRA adapters."""
    from notebookkit import FastLanguageModel  # was: from unsloth import FastLanguageModel
    max_seq_length = 2048 # Choose any! We auto support RoPE Scaling internally!
    dtype = None # None for auto detection. Float16 for Tesla T4, V100, Bfloat16 for Ampere+
    load_in_4bit = True # Use 4bit quantization to reduce memory usage. Can be False.

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name = "notebookkit/tiny-llama",  # here: the tiny default
        max_seq_length = max_seq_length,
        dtype = dtype,
        load_in_4bit = load_in_4bit,
    )

    model = FastLanguageModel.get_peft_model(
        model,
        r = 16, # Choose any number > 0 ! Suggested 8, 16, 32, 64, 128
        target_modules = ["q_proj", "k_proj", "v_proj", "o_proj",
                          "gate_proj", "up_proj", "down_proj",],
        lora_alpha = 16,
        lora_dropout = 0, # Supports any, but = 0 is optimized
        bias = "none",    # Supports any, but = "none" is optimized
        use_gradient_checkpointing = "unsloth", # True or "unsloth" for very long context
        random_state = 3407,
        use_rslora = False,  # We support rank stabilized LoRA
        loftq_config = None, # And LoftQ
    )
    return FastLanguageModel, model, tokenizer, max_seq_length


def _notebooks_sft_config():
    """The training settings, the same in both notebooks (``args = SFTConfig(...)`` of the trainer cell)."""
    from trl import SFTConfig

    return SFTConfig(
        per_device_train_batch_size = 2,
        gradient_accumulation_steps = 4,
        warmup_steps = 5,
        max_steps = 2,  # here: 2 instead of 60
        learning_rate = 2e-4,
        logging_steps = 1,
        optim = "adamw_8bit",
        weight_decay = 0.001,
        lr_scheduler_type = "linear",
        seed = 3407,
        output_dir = "outputs",
        report_to = "none", # Use TrackIO/WandB etc
        use_cpu = ON_CPU,  # here: TRL asks for it on a machine without a GPU
    )


def test_alpaca_notebook_cells(one_thread_cells):
    FastLanguageModel, model, tokenizer, max_seq_length = _first_two_cells()

    alpaca_prompt = """Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.

### Instruction:
{}

### Input:
{}

### Response:
{}"""

    EOS_TOKEN = tokenizer.eos_token # Must add EOS_TOKEN
    def formatting_prompts_func(examples):
        instructions = examples["instruction"]
        inputs       = examples["input"]
        outputs      = examples["output"]
        texts = []
        for instruction, input, output in zip(instructions, inputs, outputs):
            # Must add EOS_TOKEN, otherwise your generation will go on forever!
            text = alpaca_prompt.format(instruction, input, output) + EOS_TOKEN
            texts.append(text)
        return { "text" : texts, }

    from datasets import load_dataset
    from notebookkit.data import dataset_path  # here: the bundled Alpaca rows instead of a Hub download
    dataset = load_dataset("json", data_files = str(dataset_path("alpaca")), split = "train")
    dataset = dataset.map(formatting_prompts_func, batched = True,)

    from notebookkit.train import FastSFTTrainer as SFTTrainer  # was: from trl import SFTTrainer
    trainer = SFTTrainer(
        model = model,
        tokenizer = tokenizer,
        train_dataset = dataset,
        dataset_text_field = "text",
        max_seq_length = max_seq_length,
        packing = False, # Can make training 5x faster for short sequences.
        args = _notebooks_sft_config(),
    )

    trainer_stats = trainer.train()

    FastLanguageModel.for_inference(model) # Enable native 2x faster inference
    inputs = tokenizer(
    [
        alpaca_prompt.format(
            "Continue the fibonacci sequence.", # instruction
            "1, 1, 2, 3, 5, 8", # input
            "", # output - leave this blank for generation!
        )
    ], return_tensors = "pt").to(DEVICE)  # here: the device

    outputs = model.generate(**inputs, max_new_tokens = 64, use_cache = True)
    tokenizer.batch_decode(outputs)

    model.save_pretrained("lora_model")  # Local saving
    tokenizer.save_pretrained("lora_model")

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer_stats.global_step == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert outputs.shape[1] > inputs["input_ids"].shape[1]
    assert Path("lora_model/adapter_config.json").is_file()
    assert model.notebookkit_banner.is_on("LoRA fast path")


def test_conversational_notebook_cells(one_thread_cells):
    FastLanguageModel, model, tokenizer, max_seq_length = _first_two_cells()

    from notebookkit.chat_templates import get_chat_template  # was: from unsloth.chat_templates import ...

    tokenizer = get_chat_template(
        tokenizer,
        chat_template = "llama-3.1",
    )

    def formatting_prompts_func(examples):
        convos = examples["conversations"]
        texts = [tokenizer.apply_chat_template(convo, tokenize = False, add_generation_prompt = False) for convo in convos]
        return { "text" : texts, }

    from datasets import load_dataset
    from notebookkit.data import dataset_path  # here: bundled ShareGPT rows instead of a Hub download
    dataset = load_dataset("json", data_files = str(dataset_path("chat_sharegpt")), split = "train")

    from notebookkit.chat_templates import standardize_sharegpt  # was: from unsloth.chat_templates import ...
    dataset = standardize_sharegpt(dataset)
    dataset = dataset.map(formatting_prompts_func, batched = True,)

    from notebookkit.train import FastSFTTrainer as SFTTrainer  # was: from trl import SFTConfig, SFTTrainer
    from transformers import DataCollatorForSeq2Seq
    trainer = SFTTrainer(
        model = model,
        tokenizer = tokenizer,
        train_dataset = dataset,
        dataset_text_field = "text",
        max_seq_length = max_seq_length,
        data_collator = DataCollatorForSeq2Seq(tokenizer = tokenizer),
        packing = False, # Can make training 5x faster for short sequences.
        args = _notebooks_sft_config(),
    )

    from notebookkit.chat_templates import train_on_responses_only  # was: from unsloth.chat_templates import ...
    trainer = train_on_responses_only(trainer)

    tokenizer.decode(trainer.train_dataset[5]["input_ids"])
    space = tokenizer(" ", add_special_tokens = False).input_ids[0]
    masked = tokenizer.decode([space if x == -100 else x for x in trainer.train_dataset[5]["labels"]])

    trainer_stats = trainer.train()

    tokenizer = get_chat_template(
        tokenizer,
        chat_template = "llama-3.1",
    )
    FastLanguageModel.for_inference(model) # Enable native 2x faster inference

    messages = [
        {"role": "user", "content": "Continue the fibonacci sequence: 1, 1, 2, 3, 5, 8,"},
    ]
    inputs = tokenizer.apply_chat_template(
        messages,
        tokenize = True,
        add_generation_prompt = True, # Must add for generation
        return_tensors = "pt",
        return_dict = False,  # here: transformers 5 returns a dict by default, and generate(input_ids=) needs the ids
    ).to(DEVICE)  # here: the device

    outputs = model.generate(input_ids = inputs, max_new_tokens = 64, use_cache = True,
                             temperature = 1.5, min_p = 0.1)
    tokenizer.batch_decode(outputs)

    conversation = dataset[5]["conversations"]
    answers = [t["content"] for t in conversation if t["role"] == "assistant"]
    questions = [t["content"] for t in conversation if t["role"] == "user"]
    assert all(a.strip() in masked for a in answers), "assistant turns stay in the labels"
    assert not any(q.strip() in masked for q in questions), "user turns are masked"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer_stats.global_step == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert outputs.shape[1] > inputs.shape[1]
