"""The package list, found with setuptools' find (pyproject.toml has everything else): every
package under dtorch/, and launcher/ installed as `dtorch_launcher`, because a generic top-level
module named `launcher` would collide with other packages in site-packages. pyproject.toml alone
cannot map one folder to another name while finding the rest."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["dtorch", "dtorch.*"]) + ["dtorch_launcher"],
      package_dir={"dtorch_launcher": "launcher"})
