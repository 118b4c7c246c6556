"""Codex's apply_patch grammar (codex-rs/core/src/tool_apply_patch.lark, as Codex sends it) and an
independent check of outputs in a Lark grammar: the official `lark` package's Earley parser, not
the llguidance matcher that generated them."""

from __future__ import annotations

from pathlib import Path

import lark

APPLY_PATCH_GRAMMAR = (Path(__file__).parent / "gateway" / "data" / "codex_apply_patch.lark").read_text()


def lark_parser(grammar: str) -> lark.Lark:
    """Lark's parser for `grammar`; a terminal that may match nothing (`/(.*)/`, which Lark's
    dynamic lexer refuses) becomes the same language as an optional `/(.+)/`."""
    return lark.Lark(grammar.replace("/(.*)/", "/(.+)/?"))
