"""What the curated notebooks' cells share, kept here once so that a notebook a user copies needs nothing
but ``import notebookkit`` and each shared step is one call in it.

* :func:`apply_script_arguments`: a notebook's jupytext source (``notebooks/sft/chat_sft.py``) is also a
  script; run from a terminal (``python``, ``torchrun``, ``accelerate launch``) it takes its parameters from
  ``--config FILE`` (YAML or JSON) and ``--NAME VALUE`` flags. In Jupyter (papermill, nbmake) it does nothing:
  there papermill's injected cell sets the parameters.
* :func:`save_parameters`: writes the run's parameters to a YAML/JSON file that ``--config`` reads back.
* :func:`resolve_parameters`: fills the parameters left at ``None`` with the values for this machine (a GPU
  or the CPU), seeds torch, creates the output folder and prints what was chosen.
* :func:`first_and_last`: the mean of a logged metric over the first and the last logged steps, what each
  notebook's last cell (the learning-signal check) compares.
* :func:`plot_loss_curve`: the training (and held-back) loss of a finished run, as a figure.
"""

from __future__ import annotations

import ast
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, MutableMapping, Optional, Sequence

#: Types a notebook parameter may hold (what papermill and a YAML file can express).
_PARAMETER_TYPES = (type(None), bool, int, float, str, list, tuple, dict)
#: Where apply_script_arguments records the parameters cell's names in the notebook's namespace.
PARAMETER_NAMES_KEY = "_NOTEBOOK_PARAMETERS"
#: UPPER_CASE names of the install cell, which is not the parameters cell.
_INSTALL_CELL_NAMES = {"NOTEBOOKKIT_SOURCE"}


def running_in_a_kernel() -> bool:
    """True inside a Jupyter kernel (JupyterLab, papermill, nbmake); False in a plain ``python`` process."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def notebook_parameters(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The notebook's parameters found in ``namespace``: every UPPER_CASE name holding a plain value."""
    return {name: value for name, value in namespace.items()
            if name.isupper() and not name.startswith("_") and name not in _INSTALL_CELL_NAMES
            and isinstance(value, _PARAMETER_TYPES)}


def parse_flag_value(text: str) -> Any:
    """A flag's text as a Python value: ``none``/``null`` -> None, ``true``/``false`` -> bool, numbers,
    lists (``"[1, 2]"``); anything else stays a string."""
    lowered = text.strip().lower()
    if lowered in ("none", "null", ""):
        return None
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text


def _coerce(name: str, value: Any, default: Any, source: str, text: Optional[str] = None) -> Any:
    """``value`` in the type of the parameter's default: a float parameter takes an int, a text parameter
    keeps a flag's text as typed (``--chat_template 3`` is ``"3"``) and also takes a bool (a parameter such
    as ``GRADIENT_CHECKPOINTING`` is ``"auto"``, True or False). ``None`` always passes ("choose for me")."""
    if value is None or default is None:
        return value
    if isinstance(default, str):
        if isinstance(value, (str, bool)):
            return value
        return text if text is not None else str(value)
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(default, bool) and isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))
        value = type(default)(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise SystemExit(f"{source}: {name}={value!r} is not a {type(default).__name__} like its default "
                         f"{default!r}; fix the value.")
    return value


def _read_config_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise SystemExit(f"{path} is YAML but PyYAML is not installed: `pip install pyyaml`, or use JSON.") from None
        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"{path} must hold one mapping of parameter -> value.")
    return data


def _parameter_name(raw: str, known: Mapping[str, Any], source: str) -> str:
    name = raw.strip().lstrip("-").replace("-", "_").upper()
    if name not in known:
        raise SystemExit(f"{source}: unknown parameter {raw!r}. This notebook's parameters: {', '.join(known)}.")
    return name


def apply_script_arguments(namespace: MutableMapping[str, Any], argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Override the notebook's parameters from the command line when its source runs as a script.

    ``python notebooks/sft/chat_sft.py --config run.yaml --max_steps 60`` (or under ``torchrun`` /
    ``accelerate launch``): the file's values are applied first, then the flags. Names are the parameters
    cell's, in any case, ``-`` or ``_`` (``--MAX_STEPS``, ``--max-steps``); values are converted to the type
    of the parameter's default, ``none`` gives ``None``. ``--help`` lists the parameters.

    Call it right after the parameters cell: it records the names found there (under
    ``PARAMETER_NAMES_KEY`` in ``namespace``) for :func:`save_parameters`. Inside a Jupyter kernel it
    changes nothing else (papermill injects the parameters there), unless ``argv`` is given. Returns the
    parameters it set.

    Raises:
        SystemExit: an unknown parameter, a value of the wrong type, a malformed flag.
    """
    known = notebook_parameters(namespace)
    namespace[PARAMETER_NAMES_KEY] = list(known)
    if argv is None:
        if running_in_a_kernel():
            return {}
        argv = sys.argv[1:]
    args = list(argv)
    if any(a in ("-h", "--help") for a in args):
        print("parameters (--NAME VALUE, or in a --config YAML/JSON file):")
        for name, value in known.items():
            print(f"  --{name.lower()} {value!r}")
        raise SystemExit(0)
    pairs: list[tuple[str, str]] = []
    while args:
        flag = args.pop(0)
        if not flag.startswith("--"):
            raise SystemExit(f"command line: expected --NAME VALUE, got {flag!r}.")
        if "=" in flag:
            key, text = flag.split("=", 1)
        elif args:
            key, text = flag, args.pop(0)
        else:
            raise SystemExit(f"command line: {flag} has no value.")
        pairs.append((key, text))
    updates: dict[str, Any] = {}
    for key, text in pairs:  # the file first, whatever its place on the line, then the flags
        if key == "--config":
            for raw, value in _read_config_file(text).items():
                name = _parameter_name(str(raw), known, text)
                updates[name] = _coerce(name, value, known[name], text)
    for key, text in pairs:
        if key != "--config":
            name = _parameter_name(key, known, "command line")
            updates[name] = _coerce(name, parse_flag_value(text), known[name], "command line", text)
    namespace.update(updates)
    return updates


def save_parameters(namespace: Mapping[str, Any], path: str, **changes: Any) -> Path:
    """Write the parameters cell's names with their current values (as resolved for this machine), with
    ``changes`` applied, to ``path`` (YAML, or JSON for a ``.json`` path): the file ``--config`` reads when
    the notebook's ``.py`` form runs as a script. Returns the path.

    Raises:
        ValueError: :func:`apply_script_arguments` has not run in ``namespace`` (it records the names).
    """
    names = namespace.get(PARAMETER_NAMES_KEY)
    if names is None:
        raise ValueError("call apply_script_arguments(globals()) right after the parameters cell first: "
                         "it records which names are the notebook's parameters")
    unknown = set(changes) - set(names)
    if unknown:
        raise ValueError(f"not parameters of this notebook: {sorted(unknown)}")
    values = {name: changes.get(name, namespace.get(name)) for name in names}
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        out.write_text(json.dumps(values, indent=2) + "\n")
    else:
        import yaml

        out.write_text(yaml.safe_dump(values, sort_keys=False))
    return out


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def resolve_parameters(namespace: MutableMapping[str, Any], *, gpu: Mapping[str, Any], cpu: Mapping[str, Any],
                       on_gpu: Optional[bool] = None) -> bool:
    """Fill each parameter still ``None`` with its value for this machine, and start the run.

    ``gpu`` and ``cpu`` map parameter names to their defaults on a GPU and on the CPU; a parameter the user
    set (anything but ``None``, ``0`` and ``False`` included) is kept. Then torch is seeded with ``SEED``, the
    folder ``OUTPUT_DIR`` is created (where the notebook has them) and one line says what was chosen.
    Returns whether this run is on a GPU (``on_gpu`` forces the answer).
    """
    import torch

    if set(gpu) != set(cpu):
        raise ValueError(f"gpu and cpu defaults must name the same parameters: {sorted(set(gpu) ^ set(cpu))}")
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    defaults = gpu if on_gpu else cpu
    for name, value in defaults.items():
        if namespace.get(name) is None:
            namespace[name] = value
    if "SEED" in namespace:
        torch.manual_seed(namespace["SEED"])
    if namespace.get("OUTPUT_DIR"):
        os.makedirs(namespace["OUTPUT_DIR"], exist_ok=True)
    if _is_main_process():
        device = torch.cuda.get_device_name(0) if on_gpu and torch.cuda.is_available() else "CPU"
        print(f"device: {device} | " + " | ".join(f"{name}: {namespace[name]}" for name in defaults))
    return bool(on_gpu)


def _log_history(source: Any) -> list[dict]:
    state = getattr(source, "state", None)
    return list(getattr(state, "log_history", source))


def first_and_last(source: Any, key: str, n: int = 3, rows_with: Iterable[str] = ()) -> tuple[float, float]:
    """Mean of ``key`` over the first ``n`` and over the last ``n`` logged steps.

    ``source`` is a trainer (its ``state.log_history`` is read) or that list itself; only the rows holding
    ``key`` and every name in ``rows_with`` count (``rows_with=("loss",)`` keeps the training steps).

    Raises:
        ValueError: no logged row has ``key``.
    """
    needed = (key, *rows_with)
    values = [row[key] for row in _log_history(source) if all(k in row for k in needed)]
    if not values:
        raise ValueError(f"no logged step has {' and '.join(map(repr, needed))}: did training run and log?")
    if n < 1:
        raise ValueError(f"n={n}: compare at least one step")
    return statistics.mean(values[:n]), statistics.mean(values[-n:])


def plot_loss_curve(source: Any, path: Optional[str] = None, title: str = "Loss curve"):
    """The training loss per step, and the held-back loss where it was evaluated, as a matplotlib figure
    (saved to ``path`` when given)."""
    import matplotlib.pyplot as plt

    history = _log_history(source)
    train_log = [(h["step"], h["loss"]) for h in history if "loss" in h]
    eval_log = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    if train_log:
        ax.plot(*zip(*train_log), label="training loss")
    if eval_log:
        ax.plot(*zip(*eval_log), "o-", label="held-back loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig
