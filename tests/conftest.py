from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_model import bundled_dir, make_tiny_model

pytest_plugins = ["tests.conftest_redis"]

CACHE_DIR = Path.home() / ".cache" / "batchgate"

# One intra-op thread: the test models are too small to gain from two, and on a 2-core machine an
# OpenMP barrier whose partner thread is descheduled (the test client, Redis, a second server)
# turns a 20 us op into a 20 ms one.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda` tests need a GPU, which CI does not have by design: skipped here, saying so, and run
    on a GPU machine by bench/gpu_check.py."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU here); bench/gpu_check.py runs it on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as a Hugging Face folder (converted on first use)."""
    return bundled_dir(CACHE_DIR)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """A random-weight 2-layer Llama with the real tokenizer and chat template."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), real_model_dir)


# The test process ends without the interpreter's finalization, once pytest has reported. Twice, a
# run whose every test had passed segfaulted after it (3167888, and CI on 242bbc5), past the point
# where faulthandler can say where; daemon threads of the in-process servers the tests start
# (uvicorn, AnyIO workers, the grammar thread) are still alive then. Servers' own exits are tested
# as subprocesses, with status 0 (tests/chaos/test_drain.py).
_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
