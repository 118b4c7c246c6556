"""The engine's one C++ kernel: decode attention straight from the paged KV cache, on the CPU.

Compiled with the machine's C++ compiler on first use (about 15 s on 2 cores) through
`torch.utils.cpp_extension`, then cached (under $TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions) and loaded in well under a second. `-march=native`: it is built where it
runs. Without a compiler the engine falls back to the torch path (`attention_backend="auto"`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"

DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]

_lock = threading.Lock()
_loaded: DecodeAttention | None = None
_error: str | None = None


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv's own (the `ninja` package) is not on it unless the
    venv is activated."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def paged_decode_attention() -> DecodeAttention:
    """The compiled op `(q, k_cache, v_cache, block_tables, context_lens, scale) -> out`; raises
    RuntimeError (with the compiler's reason) if it cannot be built here."""
    global _loaded, _error
    with _lock:
        if _loaded is None and _error is None:
            try:
                from torch.utils.cpp_extension import load

                _put_ninja_on_path()

                load(
                    name="batchgate_native",
                    sources=[str(SOURCE)],
                    # -fopenmp: at::parallel_for is inlined from ATen's headers and runs serially
                    # without it; the runtime is torch's own libgomp (same soname, already loaded).
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                _loaded = torch.ops.batchgate.paged_decode_attention
            except Exception as exc:  # noqa: BLE001 - any build failure means "not available"
                _error = f"{type(exc).__name__}: {exc}"
        if _loaded is None:
            raise RuntimeError(f"the native paged attention kernel could not be built: {_error}")
        return _loaded


def resolve_decode_attention(backend: str, device: torch.device) -> DecodeAttention | None:
    """The kernel for `backend` ("auto", "native", "torch") on `device`; None means the torch path."""
    if backend == "torch" or device.type != "cpu":
        if backend == "native" and device.type != "cpu":
            raise ValueError("attention_backend native is CPU-only")
        return None
    try:
        return paged_decode_attention()
    except RuntimeError as exc:
        if backend == "native":
            raise
        logger.warning("%s; decode attention falls back to the torch path", exc)
        return None
