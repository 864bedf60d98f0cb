"""Package list for the `flashpd` namespace mapped onto the top-level folders.

pyproject.toml maps `flashpd.<part>` onto `<part>/`; setuptools needs every subpackage
listed, which this computes from the folders' `__init__.py` files.
"""

import os

from setuptools import setup

ROOTS = {
    "flashpd": "flashpd",
    "flashpd.model": "model",
    "flashpd.engine": "engine",
    "flashpd.kernels": "kernels",
    "flashpd.services": "services",
    "flashpd.bench": "bench",
}


def _packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, folder)
                found.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return found


setup(packages=_packages(), package_dir=ROOTS)
