"""docs/CONFIGURATION.md is what the settings' declarations render, and names every flag of
`batchgate serve` with its variable."""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway import cli, settings_doc
from gateway.settings import option_specs

PAGE = Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md"


def test_the_committed_page_is_what_the_code_renders() -> None:
    assert PAGE.read_text() == settings_doc.render(), (
        "docs/CONFIGURATION.md differs from the settings' declarations: run `make docs`"
    )


def _serve_flags() -> set[str]:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    return {s for a in serve._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_every_flag_of_serve_has_a_row_with_its_variable_and_default() -> None:
    page = settings_doc.render()
    rows = {line.split(" | ")[0].removeprefix("| ").split("`")[1]: line for line in page.splitlines()
            if line.startswith("| `--")}
    assert set(rows) == _serve_flags()
    for spec in option_specs():
        assert f"`{spec.env}`" in rows[spec.flag]


def test_sizes_and_lists_read_as_they_are_written() -> None:
    assert settings_doc._size(4 * 1024**2) == "4MiB"
    assert settings_doc._size(200 * 1000**2) == "200MB"
    assert settings_doc._size(1536) == "1536"
    page = settings_doc.render()
    assert "| `--max-body-bytes` | `BATCHGATE_MAX_BODY_BYTES` | `4MiB` |" in page
    assert "| `--length-buckets` | `BATCHGATE_LENGTH_BUCKETS` | `256,1024,4096` |" in page
    assert "| `--model` | `BATCHGATE_MODEL` | not set |" in page


def test_the_generator_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "CONFIGURATION.md"
    assert settings_doc.main([str(out)]) == 0
    assert out.read_text() == settings_doc.render()
    assert settings_doc.main(["--check"]) == 2
