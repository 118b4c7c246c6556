"""The package as a user installs it carries every source its C++ kernels need.

From the checkout's files (what a fresh clone has: tracked and not-ignored ones, so no stale
build/ or egg-info list can add what pyproject.toml leaves out) the test builds the sdist, the
wheel from that sdist (as `pip install` of an sdist does), checks both hold every file of the
kernels' csrc folder, installs the wheel into a new environment outside the checkout, and there,
in a subprocess, has the engine compile its kernels from the installed copy into an empty
TORCH_EXTENSIONS_DIR and load them: the native kernels, not the torch-ops fallback (one compile).
Then the installed package serves: `python -m gateway.cli serve` from that environment answers a
chat request with the bundled model on those kernels.

The new environment sees the test venv's packages (torch, ...) through a `.pth` line; a path
added that way is not a site directory, so the editable install's own `.pth` there (which puts
the checkout on the path) is not run, and `engine` can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]

# Run in the new environment: compile and load the kernels, say from where.
PROBE = """
import json, sys
import torch
import {module} as native

out = {{"module": native.__file__, "sources": native.sources(), "build_name": native.build_name()}}
try:
    native.native_kernels()
    out["error"] = None
except RuntimeError as exc:
    out["error"] = str(exc)
from engine.resolve import resolve_kernels
out["resolved"] = resolve_kernels("auto", torch.device("cpu")) is not None
print(json.dumps(out))
"""


def _checkout_files() -> list[Path]:
    """The checkout's files as a clone has them (tracked, and new ones not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    return [Path(name) for name in listed if name and (REPO / name).is_file()]


def _native_module() -> tuple[str, list[Path]]:
    """The engine's kernel loader (the module that defines `native_kernels`) as a dotted name, and
    the C++ files of the csrc folders under engine/, relative to the checkout."""
    loaders = [
        path for path in sorted((REPO / "engine").rglob("*.py"))
        if "def native_kernels(" in path.read_text(encoding="utf-8")
    ]
    assert len(loaders) == 1, loaders
    module = ".".join(loaders[0].relative_to(REPO).with_suffix("").parts)
    sources = sorted(
        path.relative_to(REPO)
        for csrc in (REPO / "engine").rglob("csrc")
        for path in csrc.iterdir()
        if path.suffix in (".cpp", ".h")
    )
    assert any(p.suffix == ".h" for p in sources), sources  # kernels.cpp includes headers
    return module, sources


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{args}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the kernels"
)
def test_the_installed_wheel_compiles_and_loads_the_native_kernels(tmp_path: Path) -> None:
    module, csrc_files = _native_module()

    source = tmp_path / "src"
    for name in _checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)

    # The sdist, and the wheel built from it.
    dist = tmp_path / "dist"
    build_sdist = f"import setuptools.build_meta as b; print(b.build_sdist({str(dist)!r}))"
    sdist = dist / _run([sys.executable, "-c", build_sdist], cwd=source).strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        root = archive.getnames()[0].split("/")[0]
        in_sdist = {name.removeprefix(root + "/") for name in archive.getnames()}
        archive.extractall(tmp_path / "sdist", filter="data")
    missing = [str(p) for p in csrc_files if p.as_posix() not in in_sdist]
    assert not missing, f"the sdist lacks {missing}"

    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(dist), str(tmp_path / "sdist" / root)],
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("batchgate-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    missing = [str(p) for p in csrc_files if p.as_posix() not in in_wheel]
    assert not missing, f"the wheel lacks {missing}"
    # The admin console's templates and vendored assets (issue 44): a wheel serves /ui as it is.
    console = [p for p in _checkout_files() if p.parts[:2] == ("gateway", "console") and p.suffix != ".py"]
    missing = [str(p) for p in console if p.as_posix() not in in_wheel]
    assert console and not missing, f"the wheel lacks the console's {missing}"

    # A new environment with the test venv's packages on its path, and the wheel in its own.
    env_dir = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=tmp_path)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).strip())
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "test_venv_packages.pth").write_text("".join(f"{path}\n" for path in ours))
    _run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--target", str(site), str(wheel)],
        cwd=tmp_path,
    )

    # The kernels, compiled from the installed sources into an empty cache, from a folder outside
    # the checkout.
    extensions = tmp_path / "torch_extensions"
    workdir = tmp_path / "run"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    out = json.loads(_run([str(python), "-c", PROBE.format(module=module)], cwd=workdir, env=env)
                     .strip().splitlines()[-1])

    assert Path(out["module"]).is_relative_to(site), out["module"]
    assert not Path(out["module"]).resolve().is_relative_to(REPO), out["module"]
    assert out["sources"] and all(Path(p).is_relative_to(site) for p in out["sources"]), out["sources"]
    assert out["error"] is None, out["error"]
    assert out["resolved"], "the engine fell back to torch ops"
    built = list((extensions / out["build_name"]).glob("*.so"))
    assert built, f"nothing was compiled under {extensions}"

    # The installed package serves a chat request on those kernels (the bundled model, converted
    # once per machine under ~/.cache/batchgate).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with log.open("w") as out_file:
        server = subprocess.Popen(
            [str(python), "-m", "gateway.cli", "serve", "--port", str(port), "--embedding-model", "none",
             "--max-num-seqs", "2", "--max-model-len", "2048", "--kv-cache-memory", "128MiB"],
            cwd=workdir, env=env, stdout=out_file, stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:  # until /ready answers 200 (the model loads in the background)
            assert server.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(base + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the installed server did not become ready"
            time.sleep(0.2)
        reply = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
                  "messages": [{"role": "user", "content": "Hi"}]},
            timeout=60.0,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0
        ready = [line for line in log.read_text().splitlines() if "engine ready" in line]
        assert ready and "on the int8 kernels" in ready[0], log.read_text()[-4000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
