"""``push_to_hub_merged`` / ``push_to_hub_gguf``: export into a temporary folder, upload it with
``huggingface_hub``'s upload API (``create_repo`` + ``upload_folder``).

Uploading needs a network and a token, so both are checked before any export work: offline
(``HF_HUB_OFFLINE=1``), unreachable or not logged in, the call fails at once with one message. The
form (``save_method`` / ``quantization_method``, rows of :mod:`notebookkit.export_forms`) is checked
before that.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch.nn as nn

from .checks import ExportError, check_save_method

__all__ = ["push_to_hub_merged", "push_to_hub_gguf", "require_hub"]


def _offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() not in ("", "0", "false", "no"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # noqa: BLE001
        return False


def require_hub(repo_id: str, token: Optional[str]):
    """An ``HfApi`` that can upload to ``repo_id``; raises one readable error when it cannot."""
    if not repo_id or "/" not in str(repo_id):
        raise ExportError(f"repo_id={repo_id!r} should look like 'your-name/model-name'.")
    if _offline():
        raise ExportError(
            f"Cannot push to the Hugging Face Hub ({repo_id}): this session is offline (HF_HUB_OFFLINE=1). "
            "Nothing was exported. Save locally with save_pretrained_merged / save_pretrained_gguf, or unset "
            "HF_HUB_OFFLINE on a machine with network access."
        )
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.whoami()
    except Exception as exc:  # noqa: BLE001 - network errors, missing or invalid token
        raise ExportError(
            f"Cannot push to the Hugging Face Hub ({repo_id}): {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}. "
            "Nothing was exported. Check the network and log in (huggingface_hub.login(), or pass token='hf_...')."
        ) from None
    return api


def _export_and_upload(repo_id: str, token: Optional[str], private: Optional[bool], commit_message: str,
                       temporary_location: Optional[Union[str, os.PathLike]], export: Callable[[Path], Any]) -> str:
    """Check the hub (:func:`require_hub`), ``export(folder)`` into a temporary folder, upload that folder
    to ``repo_id``, delete it."""
    api = require_hub(repo_id, token)
    work = Path(tempfile.mkdtemp(prefix="notebookkit-push-", dir=temporary_location))
    try:
        folder = work / str(repo_id).split("/")[-1]
        export(folder)
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=commit_message)
        return str(getattr(info, "commit_url", info))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def push_to_hub_merged(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    save_method: str = "merged_16bit",
    token: Optional[str] = None,
    private: Optional[bool] = None,
    commit_message: str = "Upload model exported by notebookkit",
    temporary_location: Optional[Union[str, os.PathLike]] = None,
    **kwargs: Any,
) -> str:
    """``save_pretrained_merged`` into a temporary folder, then upload it to ``repo_id``; returns the commit URL."""
    from .merged import save_pretrained_merged

    check_save_method(save_method)  # a bad form fails before the network check
    export = functools.partial(save_pretrained_merged, model, tokenizer=tokenizer, save_method=save_method, **kwargs)
    return _export_and_upload(repo_id, token, private, commit_message, temporary_location, export)


def push_to_hub_gguf(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    quantization_method: Union[str, Sequence[str]] = "q8_0",
    token: Optional[str] = None,
    private: Optional[bool] = None,
    commit_message: str = "Upload GGUF exported by notebookkit",
    temporary_location: Optional[Union[str, os.PathLike]] = None,
    **kwargs: Any,
) -> str:
    """``save_pretrained_gguf`` into a temporary folder, then upload the files to ``repo_id``; returns the commit URL."""
    from .gguf_file import normalize_quantization_methods, save_pretrained_gguf

    normalize_quantization_methods(quantization_method)  # a bad method fails before the network check
    export = functools.partial(save_pretrained_gguf, model, tokenizer=tokenizer, quantization_method=quantization_method,
                               **kwargs)
    return _export_and_upload(repo_id, token, private, commit_message, temporary_location, export)
