"""The wheel a user installs, not the developer's editable checkout: built from the source tree,
installed without -e into a new virtualenv, every module of the tree imported from it, and its
`kvpilot` command serving a generated model.

The new virtualenv reaches the dependencies through a path entry to this environment's
site-packages (installing torch again would take minutes); kvpilot itself comes only from the wheel:
the editable install's import hook lives in a .pth file there that a plain path entry never runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
COMPONENT_DIRS = {"kvpilot": "kvpilot", "kvpilot.engine": "engine", "kvpilot.kernels": "kernels",
                  "kvpilot.operator": "operator", "kvpilot.gateway": "gateway",
                  "kvpilot.localcluster": "localcluster"}

pytestmark = pytest.mark.slow


def source_modules() -> list[str]:
    """Every module of the source tree, by the name it installs under."""
    modules = []
    for package, folder in COMPONENT_DIRS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and parts[-1] == "__main__":
                continue
            modules.append(".".join([package, *parts]))
    return modules


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin folder of a new virtualenv holding kvpilot from a freshly built wheel."""
    root = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ in the source folder, and a later build would
    # pick up modules from it that the package list no longer names.
    source = shutil.copytree(REPO, root / "source", ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(root / "dist"), str(source)], check=True, cwd=root)
    (wheel,) = (root / "dist").glob("kvpilot-*.whl")
    venv.create(root / "venv", with_pip=False)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    str(wheel)], check=True, cwd=root)
    return root / "venv" / "bin"


def test_every_module_of_the_tree_imports_from_the_wheel(installed):
    modules = source_modules()
    assert "kvpilot.engine.quantization.linear" in modules and "kvpilot.gateway.proxy" in modules
    script = (
        "import importlib, json, sys\n"
        "failed = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed[name] = f'{type(exc).__name__}: {exc}'\n"
        "    else:\n"
        "        if not module.__file__.startswith(sys.prefix):\n"
        "            failed[name] = f'imported from {module.__file__}, not the wheel'\n"
        "print(json.dumps(failed))\n"
    )
    result = subprocess.run([installed / "python", "-c", script, json.dumps(modules)], capture_output=True,
                            text=True, cwd=installed, check=True)
    assert json.loads(result.stdout) == {}


def test_the_wheel_carries_the_kernel_sources(installed):
    code = ("import json, pathlib, kvpilot.kernels\n"
            "print(json.dumps(sorted(p.name for p in pathlib.Path(kvpilot.kernels.__file__).parent.glob('*.[ch]'))))")
    listed = subprocess.run([installed / "python", "-c", code], capture_output=True, text=True, cwd=installed,
                            check=True)
    names = json.loads(listed.stdout)
    assert names == sorted(p.name for p in (REPO / "kernels").glob("*.[ch]"))


@pytest.mark.parametrize("component", ["operator", "gateway", "serve", "crd"])
def test_the_wheels_command_runs_each_component(installed, component):
    result = subprocess.run([installed / "kvpilot", component, "--help"], capture_output=True, text=True,
                            cwd=installed)
    assert result.returncode == 0, result.stderr
    assert "usage: kvpilot " + component in result.stdout


def test_the_wheels_kvpilot_serve_answers_a_completion(installed, tiny_model_dir, serve_process):
    server = serve_process([str(installed / "kvpilot")], [str(tiny_model_dir), "--served-model-name", "tiny",
                                                          "--device", "cpu", "--max-model-len", "256"])
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 4
