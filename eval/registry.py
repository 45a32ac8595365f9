"""What renders each README/docs block, and what the report tools need of a study: filled by the studies, read by
:mod:`eval.render` (and kept free of imports, so that neither render nor :mod:`eval.reports` imports a study).

A block ``<!-- render: NAME SOURCES -->`` is drawn by :data:`RENDERERS` ``[NAME]``, ``"module:function"``: the study's
own report code, imported only when a block names it. Each takes the block's sources (``(path, "rel|link")`` pairs)
and flags and returns the block's lines (:func:`eval.render.render_block`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path

Renderer = Callable[[Sequence[tuple[Path, str]], Sequence[str]], list[str]]

RENDERERS: dict[str, str] = {
    "peers_test": "eval.peers.report:render_test",
    "dropin_test": "eval.dropin:render_test",
    "long_run_test": "eval.long_run.report:render_test",
    "long_run_curves": "eval.long_run.report:render_curves",
    "generative_test": "eval.sample_quality.long_report:render_test",
    "main_job": "eval.main_job:render_table",
}


def renderer(name: str) -> Renderer:
    """The function that draws blocks ``name`` (a key of :data:`RENDERERS`; ``KeyError`` naming the known ones)."""
    if name not in RENDERERS:
        raise KeyError(f"no renderer {name!r}; the registry has {sorted(RENDERERS)}")
    module, _, function = RENDERERS[name].partition(":")
    return getattr(importlib.import_module(module), function)
