"""The console's assets: the vendored htmx and Chart.js are the npm registry's files (their sha256 as
recorded), with their licenses; the wheel carries every template and asset (pyproject.toml's
package-data); the pages load nothing but files the package has."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import tomllib
from pathlib import Path

import gateway.console

PACKAGE = Path(gateway.console.__file__).parent
ROOT = Path(__file__).parents[3]


def test_the_vendored_files_are_the_published_ones_with_their_licenses() -> None:
    vendor = PACKAGE / "static" / "vendor"
    manifest = json.loads((vendor / "vendor.json").read_text())["files"]
    assert set(manifest) == {"htmx.min.js", "chart.umd.min.js"}
    for name, entry in manifest.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == entry["sha256"], name
        license_text = (vendor / entry["license_file"]).read_text()
        assert ("Zero-Clause BSD" if entry["license"] == "0BSD" else "MIT License") in license_text
    assert sorted(p.name for p in vendor.iterdir()) == sorted(
        ["vendor.json", *manifest, *(e["license_file"] for e in manifest.values())]
    )


def test_the_wheel_carries_every_template_and_asset() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["gateway.console"]
    files = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.is_file()]
    data = [f for f in files if not f.endswith((".py", ".pyc")) and "__pycache__" not in f]
    # setuptools' globs: `*` stays within one folder
    carried = [
        f for f in data if any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/") for p in patterns)
    ]
    assert data and carried == data


def test_the_pages_load_only_files_the_package_has() -> None:
    for template in (PACKAGE / "templates").glob("*.html"):
        text = template.read_text()
        assert not re.search(r'(src|href)="(https?:)?//', text), template.name  # nothing from elsewhere
        for path in re.findall(r'(?:src|href)="/ui/static/([^"]+)"', text):
            assert (PACKAGE / "static" / path).is_file(), (template.name, path)
