"""The stubs are built with the package: installing ./api/python runs protoc over the protos first.

Before setup() rather than in build_py: egg_info, which pip runs first, already needs the packages.
"""

from __future__ import annotations

import pathlib
import sys

from setuptools import setup

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import stub_builder  # beside this file, not installed

stub_builder.ensure()
setup(packages=stub_builder.packages(), package_data={"": ["*.pyi", "py.typed", "*.binpb"]})
