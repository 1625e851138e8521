"""Compiling an accelerator's windows before a daemon serves: ATC takes minutes per window on a
board and a coordinator's calls have deadlines of seconds, so primad compiles the windows it
expects plans to give it, with a progress line each, and from then on its backend loads only
compiled windows. A plan that names any other window is refused at once, naming the command
that compiles it (prima.backends.acl.backend.WindowNotCompiledError)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prima.backends.base import CompilingBackend
from prima.errors import PrimaError

if TYPE_CHECKING:  # the model code (numba) is loaded by then
    from prima.forward.loader import LoadedModel

log = logging.getLogger("prima.engine")


def compile_ahead(loaded: LoadedModel, windows: Sequence[range], say: Callable[[str], None]) -> list[range]:
    """Compile `windows` on `loaded`'s backend unless cached, then make it serve compiled windows
    only; the windows that failed to compile (each logged with ATC's reason). Nothing to do on a
    backend that does not compile."""
    backend = loaded.model.backend
    if not isinstance(backend, CompilingBackend):
        return []
    todo = [w for w in dict.fromkeys(windows) if not backend.compiled(w)]
    failed: list[range] = []
    for k, layers in enumerate(todo, 1):
        say(f"compiling NPU window {k}/{len(todo)}: layers {layers.start}-{layers.stop - 1} (ATC)")
        try:
            loaded.weights.validate(layers)
            backend.compile(layers)
        except PrimaError as exc:
            log.warning("layers %d-%d: %s", layers.start, layers.stop - 1, exc)
            failed.append(layers)
    backend.serve_compiled_only()
    return failed
