"""Package discovery for kvpilot's folder layout (the metadata is in pyproject.toml).

Each component lives in a top-level folder and installs as a subpackage of ``kvpilot``
(``engine/`` -> ``kvpilot.engine``); every package below a folder is found, so a new one can never
be left out of a wheel. ``operator`` is never importable at top level: it is a standard-library
module.
"""

from setuptools import find_packages, setup

COMPONENT_DIRS = {
    "kvpilot": "kvpilot",
    "kvpilot.engine": "engine",
    "kvpilot.kernels": "kernels",
    "kvpilot.operator": "operator",
    "kvpilot.gateway": "gateway",
    "kvpilot.localcluster": "localcluster",
}

setup(
    package_dir=COMPONENT_DIRS,
    packages=[
        f"{package}.{sub}" if sub else package
        for package, folder in COMPONENT_DIRS.items()
        for sub in ["", *find_packages(folder)]
    ],
)
