"""The gateway meets the operator at contracts (kvpilot/kube_contract.py, engine_contract.py), never
at its modules: importing every gateway module loads no operator code (nor torch, nor kopf)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import kvpilot.gateway


def test_the_gateway_imports_no_operator_module():
    modules = [f"kvpilot.gateway.{m.name}" for m in pkgutil.iter_modules(kvpilot.gateway.__path__)]
    script = ("import importlib, json, sys\n"
              "for name in json.loads(sys.argv[1]): importlib.import_module(name)\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('kvpilot.operator', 'torch', 'kopf')))))")
    loaded = subprocess.run([sys.executable, "-c", script, json.dumps(modules)], capture_output=True, text=True,
                            check=True, cwd="/")
    assert "kvpilot.gateway.proxy" in modules
    assert json.loads(loaded.stdout) == []
