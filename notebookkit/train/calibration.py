"""Calibration: a short side-by-side run of notebookkit and plain PEFT on this machine.

Both runs load the same checkpoint, add LoRA adapters with the same rank, targets and seed, and train
N optimizer steps with the same ``SFTConfig`` on the same batches in the same order. So both minimise
the same loss

    L(theta) = - (1/N_tok) * sum_t log p_theta(y_t | x_<t)

from the same starting point, and with exact arithmetic they would follow the same loss curve; the
curves differ only by floating-point rounding (the fused kernels sum in another order). What differs
is cost:

* peak memory: the largest ``torch.cuda.max_memory_allocated`` growth during the run on a GPU, or
  the peak growth of the process's resident memory (RSS, sampled every 20 ms) on a CPU;
* throughput: tokens / second over steps 2..N (step 1 pays one-off costs such as kernel compilation).

The first step is excluded from timing, not from the loss curve.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from notebookkit.compat import quiet_checkpointing_flag_deprecation

__all__ = ["CalibrationRun", "CalibrationResult", "calibrate"]

GiB = 1024**3


@dataclass
class CalibrationRun:
    """One side of the calibration."""

    name: str
    losses: list[float]
    peak_memory_gib: float
    tokens_per_s: float
    seconds: float
    memory_kind: str

    @property
    def final_loss(self) -> float:
        """Mean of the last three logged losses."""
        tail = self.losses[-3:]
        return sum(tail) / len(tail) if tail else float("nan")


@dataclass
class CalibrationResult:
    """Both runs, a plot with the two loss curves, and a one-sentence reading for this machine."""

    notebookkit: CalibrationRun
    peft: CalibrationRun
    device: str
    steps: int
    card_memory_gib: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        """notebookkit tokens/s divided by plain PEFT tokens/s."""
        return self.notebookkit.tokens_per_s / self.peft.tokens_per_s if self.peft.tokens_per_s else float("nan")

    @property
    def memory_saving(self) -> float:
        """1 - notebookkit peak / PEFT peak (positive = notebookkit needs less)."""
        if self.peft.peak_memory_gib <= 0:
            return float("nan")
        return 1.0 - self.notebookkit.peak_memory_gib / self.peft.peak_memory_gib

    @property
    def max_loss_gap(self) -> float:
        """Largest |difference| between the two loss curves, step by step."""
        pairs = list(zip(self.notebookkit.losses, self.peft.losses))
        return max((abs(a - b) for a, b in pairs), default=float("nan"))

    def summary(self) -> str:
        """One sentence: what the numbers mean for this card."""
        nk, pe = self.notebookkit, self.peft
        same = (
            f"the two loss curves agree to within {self.max_loss_gap:.3f}, so both train the same model"
            if self.max_loss_gap == self.max_loss_gap
            else "one curve is missing"
        )
        if self.device.startswith("cpu"):
            return (
                f"On this CPU ({self.steps} steps) notebookkit ran at {nk.tokens_per_s:,.0f} tokens/s vs "
                f"{pe.tokens_per_s:,.0f} for plain PEFT ({self.speedup:.2f}x) and {same}; the Triton kernels only "
                "run on a GPU, so memory and speed here say little about a GPU run."
            )
        card = f"{self.device}" + (f" ({self.card_memory_gib:.0f} GiB)" if self.card_memory_gib else "")
        headroom = ""
        if self.card_memory_gib:
            headroom = (
                f", leaving {self.card_memory_gib - nk.peak_memory_gib:.1f} GiB of the card free for a longer "
                "max_seq_length or a bigger batch"
            )
        saving = self.memory_saving
        if saving != saving:
            compared = "memory not compared"
        elif saving >= 0:
            compared = f"{saving:.0%} less memory"
        else:
            compared = (
                f"{-saving:.0%} more memory: use_gradient_checkpointing=\"auto\" keeps activations when the card "
                "has room, which is faster; True or \"offload\" trade that speed for memory"
            )
        return (
            f"On this {card}, notebookkit peaked at {nk.peak_memory_gib:.2f} GiB vs {pe.peak_memory_gib:.2f} GiB "
            f"for plain PEFT ({compared}) and ran {self.speedup:.2f}x the tokens/s "
            f"({nk.tokens_per_s:,.0f} vs {pe.tokens_per_s:,.0f}){headroom}; {same}."
        )

    def table(self) -> str:
        """A small text table of both runs."""
        rows = [("", "notebookkit", "plain PEFT")]
        rows.append((f"peak memory ({self.notebookkit.memory_kind}), GiB",
                     f"{self.notebookkit.peak_memory_gib:.3f}", f"{self.peft.peak_memory_gib:.3f}"))
        rows.append(("tokens / s", f"{self.notebookkit.tokens_per_s:,.0f}", f"{self.peft.tokens_per_s:,.0f}"))
        rows.append(("wall time, s", f"{self.notebookkit.seconds:.1f}", f"{self.peft.seconds:.1f}"))
        rows.append(("final loss", f"{self.notebookkit.final_loss:.4f}", f"{self.peft.final_loss:.4f}"))
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{width}}  {b:>12}  {c:>12}" for a, b, c in rows)

    def __str__(self) -> str:
        return self.table() + "\n" + self.summary()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def plot(self, ax: Any = None) -> Any:
        """Both loss curves overlaid on one axis. Returns the figure."""
        import matplotlib.pyplot as plt

        if ax is None:
            fig, ax = plt.subplots(figsize=(7, 3.2))
        else:
            fig = ax.figure
        for run, style in ((self.peft, dict(color="#9d9d9d", lw=3, alpha=0.7)),
                           (self.notebookkit, dict(color="#e45756", lw=1.4, ls="--"))):
            ax.plot(range(1, len(run.losses) + 1), run.losses, label=(
                f"{run.name}: {run.tokens_per_s:,.0f} tok/s, peak {run.peak_memory_gib:.2f} GiB"), **style)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"Calibration on {self.device}: same seed, same data")
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig


class _PeakMeter:
    """Peak memory growth during a block: CUDA allocator peak, or sampled host RSS on CPU."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.kind = "GPU allocated" if self.cuda else "host RSS"
        self.peak = 0

    def __enter__(self) -> "_PeakMeter":
        import torch

        from ..memory.meters import HostMemorySampler

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self._host = HostMemorySampler(0.02).__enter__()
            self.base = self._host.before
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._host.__exit__(*exc)
            self.peak = self._host.peak_rss - self.base

    @property
    def peak_gib(self) -> float:
        return max(0, self.peak) / GiB


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    return StepTimer()


def _uses_checkpointing(model: Any, mode: Any) -> bool:
    """Whether the notebookkit model recomputes activations (so the PEFT side should too)."""
    import warnings

    import torch

    if mode in (False, None):
        return False
    if mode == "auto" and not torch.cuda.is_available():
        return False  # notebookkit's "auto" never checkpoints on a CPU
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            flag = getattr(base, attr, None)
            if isinstance(flag, bool) and flag:
                return True
    return mode != "auto"


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_plain(model_name: str, max_seq_length: int, dtype: Any, load_in_4bit: bool) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.common.precision import is_bfloat16_supported

    try:
        from ..embedded.tiny import resolve_model_name

        path = resolve_model_name(model_name)
    except ImportError:
        path = model_name
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        if torch.cuda.is_available():
            dtype = torch.bfloat16 if is_bfloat16_supported() else torch.float16
        else:
            dtype = torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
    if torch.cuda.is_available():
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if load_in_4bit:
        # bitsandbytes' CPU forward decodes NF4 wrongly on AVX-512 CPUs for some shapes (and rewrites
        # weights in place in eval mode): the baseline's 4-bit layers decode with notebookkit's NF4
        # kernel on CPU tensors, which is bitsandbytes' CUDA arithmetic. On a GPU they run bitsandbytes.
        from ..base_layers.linear4bit import patch_linear4bit

        patch_linear4bit(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    tokenizer.model_max_length = max_seq_length
    return model, tokenizer


def _run(
    name: str,
    model: Any,
    tokenizer: Any,
    dataset: Any,
    steps: int,
    seed: int,
    sft_kwargs: dict[str, Any],
    responses_only: bool,
    meter: _PeakMeter,
) -> CalibrationRun:
    import torch

    from .sft import make_sft_trainer

    import datasets
    from transformers.trainer_callback import PrinterCallback

    from .callbacks import remove_progress_display

    timer = _step_timer()
    torch.manual_seed(seed)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        trainer = make_sft_trainer(
            model, tokenizer, dataset, callbacks=[timer], responses_only=False, show_banner=False,
            output_dir=sft_kwargs.pop("output_dir"), max_steps=steps, seed=seed,
            logging_steps=1, **sft_kwargs,
        )
        if responses_only:
            from ..data.responses_only import train_on_responses_only

            train_on_responses_only(trainer, verbose=False)
    finally:
        if bars:
            datasets.enable_progress_bars()
    remove_progress_display(trainer)  # quiet: the result object reports (its table and plot)
    trainer.remove_callback(PrinterCallback)
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    args = trainer.args
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    mean_len = sum(lengths) / max(1, len(lengths))
    times = timer.times
    if len(times) >= 2:
        timed = (times[-1] - times[0]) or 1e-9
        tokens_per_s = (len(times) - 1) * per_step * mean_len / timed
    else:
        tokens_per_s = steps * per_step * mean_len / max(seconds, 1e-9)
    del trainer
    return CalibrationRun(name, losses, meter.peak_gib if meter.peak else 0.0, tokens_per_s, seconds, meter.kind)


def calibrate(
    model_name: str,
    train_dataset: Any,
    *,
    steps: int = 30,
    seed: int = 3407,
    max_seq_length: int = 512,
    load_in_4bit: bool = False,
    dtype: Any = None,
    r: int = 16,
    lora_alpha: int = 16,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    chat_template: str | None = None,
    responses_only: bool = True,
    use_gradient_checkpointing: Any = "auto",
    **sft_kwargs: Any,
) -> CalibrationResult:
    """Train ``steps`` steps with notebookkit and with plain PEFT (same seed, data, config) and compare.

    Args:
        model_name: a hub name, local folder, or tiny default (``"notebookkit/tiny-llama"``).
        train_dataset: the same rows you will train on (``messages`` or ``text``).
        steps: optimizer steps per side (30 by default; a handful is enough on a CPU).
        seed: one seed for adapters and data order, used by both sides.
        max_seq_length, load_in_4bit, dtype: model loading, as in ``FastLanguageModel.from_pretrained``.
        r, lora_alpha, target_modules: LoRA settings, identical on both sides.
        chat_template: apply this template (``get_chat_template``) to both tokenizers.
        responses_only: mask non-assistant tokens on both sides.
        use_gradient_checkpointing: notebookkit's mode; plain PEFT uses Hugging Face checkpointing
            whenever notebookkit checkpoints.
        **sft_kwargs: more :func:`notebookkit.train.sft.sft_config` arguments (batch size, learning rate...).

    Returns:
        A :class:`CalibrationResult`: ``print`` it, ``.plot()`` both loss curves, ``.summary()`` one sentence.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    from ..models import FastLanguageModel
    from ..models.patching.master_weights import hold_fp32_masters

    sft_kwargs.setdefault("max_length", max_seq_length)
    per_step = sft_kwargs.get("per_device_train_batch_size", 2) * sft_kwargs.get("gradient_accumulation_steps", 4)
    rows = min(len(train_dataset), max(8, steps * per_step))
    train_dataset = train_dataset.select(range(rows))  # only what N steps read: less preprocessing
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    card = torch.cuda.get_device_properties(0).total_memory / GiB if torch.cuda.is_available() else None

    def with_template(tok: Any, model: Any) -> Any:
        if chat_template:
            from ..data.chat_templates import get_chat_template

            get_chat_template(tok, chat_template, model=model)
        return tok

    import tempfile

    scratch = tempfile.TemporaryDirectory(prefix="notebookkit-calibration-")
    sft_kwargs.setdefault("output_dir", scratch.name)  # nothing is saved; the Trainer wants a folder
    _free()
    with _PeakMeter() as meter:
        model, tok = FastLanguageModel.from_pretrained(
            model_name, max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, show_banner=False,
        )  # the notebook showed this model's banner when it loaded it; the calibration adds no copy
        torch.manual_seed(seed)
        model = FastLanguageModel.get_peft_model(
            model, r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
            bias="none", use_gradient_checkpointing=use_gradient_checkpointing, random_state=seed, show_banner=False,
        )
        checkpointing = _uses_checkpointing(model, use_gradient_checkpointing)
        nk = _run("notebookkit", model, with_template(tok, model), train_dataset, steps, seed, dict(sft_kwargs),
                  responses_only, meter)
    nk.peak_memory_gib = meter.peak_gib
    del model, tok
    _free()

    with _PeakMeter() as meter:
        model, tok = _load_plain(model_name, max_seq_length, dtype, load_in_4bit)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        torch.manual_seed(seed)
        with quiet_checkpointing_flag_deprecation():  # PEFT reads transformers' deprecated flag
            model = get_peft_model(model, LoraConfig(
                r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0, bias="none",
                task_type="CAUSAL_LM",
            ))
        hold_fp32_masters(model)  # fp16 (a T4): the trainable weights are fp32 masters, as on notebookkit's side
        pe = _run("plain PEFT", model, with_template(tok, model), train_dataset, steps, seed, dict(sft_kwargs),
                  responses_only, meter)
    pe.peak_memory_gib = meter.peak_gib
    del model, tok
    _free()
    scratch.cleanup()
    return CalibrationResult(nk, pe, device, steps, card)
