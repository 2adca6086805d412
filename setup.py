"""Package discovery, the one thing pyproject.toml cannot say on its own.

`graphdist` and its subpackages are found, never listed (a listed package that was
forgotten installs a broken wheel that only editable installs hide). Two top-level folders
install under the package: `kernels/` as `graphdist.kernels` and `examples/` as
`graphdist.examples`; their subpackages are found the same way. Everything else is in
pyproject.toml.
"""

from setuptools import find_packages, setup

MAPPED = {"graphdist.kernels": "kernels", "graphdist.examples": "examples"}


def _packages() -> list[str]:
    found = find_packages(include=["graphdist", "graphdist.*"])
    for name, folder in MAPPED.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=_packages(),
      package_dir={name: folder for name, folder in MAPPED.items()})
