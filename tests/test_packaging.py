"""The package as pip sees it: what it declares (dependencies, the torch range tested, SPDX license,
classifiers, one version), and a wheel built, installed into a fresh environment and run."""

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

import rnndrop

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _dependencies() -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, PROJECT["project"]["dependencies"])}


def test_numpy_is_declared_where_the_package_uses_it():
    """``Tensor.numpy()`` raises "Numpy is not available" without numpy: every use needs it declared."""
    users = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "rnndrop").rglob("*.py")
        if re.search(r"\.numpy\(\)|^\s*(import|from) numpy", path.read_text(), re.M)
    ]
    assert users, "no use of numpy found: drop the dependency?"
    assert "numpy" in _dependencies(), f"numpy used in {users} but not a dependency"


def test_the_torch_range_is_the_tested_one():
    spec = _dependencies()["torch"].specifier
    for tested in ("2.13.0", "2.11.0", "2.11.0+cu128", torch.__version__):
        assert spec.contains(Version(tested), prereleases=True), tested
    for untested in ("2.1.0", "2.2.2", "3.0.0"):
        assert not spec.contains(Version(untested)), untested
    readme = (ROOT / "README.md").read_text()
    assert str(spec) in readme.replace("`", "") or "torch>=2.11,<3" in readme


def test_license_classifiers_and_one_version():
    project = PROJECT["project"]
    assert project["license"] == "MIT"  # an SPDX expression, not the deprecated table
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639 forbids both
    assert "Typing :: Typed" in project["classifiers"]
    assert "Programming Language :: Python :: 3.10" in project["classifiers"]
    assert any(r.startswith("setuptools>=") and Version(r.split(">=")[1]) >= Version("77")
               for r in PROJECT["build-system"]["requires"])
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rnndrop.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", rnndrop.__version__)


def test_citation_and_changelog():
    citation = (ROOT / "CITATION.cff").read_text()
    assert "cff-version: 1.2.0" in citation and "title:" in citation and "authors:" in citation
    assert "## Unreleased" in (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_environment_and_its_command_runs(tmp_path):
    """``pip wheel`` the checkout, install the wheel (no deps: torch and numpy come from the
    system site) into a new venv, and run ``rnndrop-lm --help`` from outside the checkout."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
         str(ROOT)], check=True, timeout=600, cwd=tmp_path,
    )
    (wheel,) = wheels.glob("rnndrop-*.whl")
    assert f"rnndrop-{rnndrop.__version__}-" in wheel.name
    env = tmp_path / "env"
    venv.create(env, system_site_packages=True, with_pip=False)
    python = env / "bin" / "python"
    # torch and numpy from where this run has them: the system site, or (a venv) this run's own
    # site-packages, as a path line (its .pth files, the checkout's editable install, are not read)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    import numpy
    parents = {str(Path(module.__file__).resolve().parents[1]) for module in (torch, numpy)}
    (Path(site) / "_rnndrop_test_dependencies.pth").write_text("\n".join(sorted(parents)) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True, timeout=600, cwd=tmp_path,
    )
    done = subprocess.run([str(env / "bin" / "rnndrop-lm"), "--help"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower()
    meta = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, rnndrop; d = m.metadata('rnndrop'); "
         "print(rnndrop.__file__); print(d['Version']); print(d['License-Expression']); "
         "print(d.get_all('Requires-Dist'))"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=True,
    ).stdout.splitlines()
    assert str(env) in meta[0]  # the wheel's copy, not the checkout
    assert meta[1] == rnndrop.__version__ and meta[2] == "MIT"
    assert "numpy" in meta[3] and "torch<3,>=2.11" in meta[3]
