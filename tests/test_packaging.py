"""The package as users get it: the wheel ships `mla_backend` and `mla_kernels` (not the developer
tools), installs into a fresh venv and imports from there; and no folder of the checkout shadows a
PyPI package for a Python started in the repository root.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("mla_backend", "mla_kernels")
DEV_ONLY = ("mla_tools",)
TINY_CHECKPOINT = REPO / "checkpoints" / "deepseek-v2-tiny"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env or _clean_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _top_level_packages() -> list[str]:
    return sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the checkout's packages and pyproject.toml
    (a copy: an in-tree build would leave build/ and egg-info folders in the repository)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copy(REPO / "pyproject.toml", src)
    for name in _top_level_packages():
        shutil.copytree(REPO / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    # this venv's setuptools when it has one (no download), else pip's isolated build
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out),
          str(src)], cwd=src)
    (whl,) = out.glob("mla_backend-*.whl")
    return whl


def test_wheel_ships_the_engine_and_its_kernels_only(wheel) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in SHIPPED:
        for path in (REPO / pkg).rglob("*.py"):
            assert path.relative_to(REPO).as_posix() in names, f"{path} is not in the wheel"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(SHIPPED), f"top-level entries of the wheel: {sorted(tops)}"


def test_wheel_installs_and_imports_outside_the_checkout(wheel, tmp_path) -> None:
    """Installed with --no-deps into a fresh venv that sees the dev venv's packages (torch, ...)
    only after its own, then imported from a folder outside the repository: every module comes
    from the venv, and the developer tools are not there."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
          "--no-index", str(wheel)], cwd=tmp_path)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp_path).strip())
    # the dev venv's packages, after the fresh venv's own; the Python part of the backend stub's
    # `triton_python_backend_utils` (shipped in nvidia-pytriton) for the adapter module
    extra = [sysconfig.get_path("purelib")]
    pytriton = importlib.util.find_spec("pytriton")
    stub_utils = (Path(pytriton.origin).parent / "tritonserver" / "backends" / "python"
                  if pytriton and pytriton.origin else None)
    adapter = stub_utils is not None and (stub_utils / "triton_python_backend_utils.py").exists()
    if adapter:
        extra.append(str(stub_utils))
    (site / "zz_dev_venv.pth").write_text("\n".join(extra) + "\n")
    modules = ["mla_kernels", "mla_kernels.decode_attention", "mla_kernels.reference",
               "mla_backend", "mla_backend.engine", "mla_backend.serving.protocol"]
    if adapter:
        modules.append("mla_backend.serving.triton_model")
    script = (
        "import importlib, importlib.util, sys\n"
        f"for name in {modules!r}:\n"
        "    print(name, importlib.import_module(name).__file__)\n"
        f"print('dev-only', [importlib.util.find_spec(n) for n in {DEV_ONLY!r}])\n"
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    out = _run([str(py), "-c", script], cwd=outside).splitlines()
    files = dict(line.split(" ", 1) for line in out)
    assert set(modules) <= set(files)
    for name in modules:
        path = Path(files[name]).resolve()
        assert path.is_relative_to(site.resolve()), f"{name} came from {path}, not the wheel"
    assert files["dev-only"] == str([None] * len(DEV_ONLY))


def test_no_top_level_folder_can_shadow_a_pypi_package() -> None:
    """Every importable folder at the root is one of ours, named `mla_*` (a folder called
    `kernels` was picked up as PyPI's `kernels` package by transformers)."""
    assert _top_level_packages() == sorted(SHIPPED + DEV_ONLY)
    assert not list(REPO.glob("*.py")), "a module at the root would shadow one of the same name"


def test_transformers_loads_the_shipped_checkpoint_from_the_repository_root(tmp_path) -> None:
    """`AutoModelForCausalLM.from_pretrained` of the shipped tiny checkpoint, from a Python started
    in the repository root, where PyPI's `kernels` package is installed: transformers then imports
    `kernels` (here only its metadata, in a version transformers accepts, stands in for it) and a
    folder of that name at the root used to be found instead (ImportError: cannot import name
    'CUDAProperties' from 'kernels')."""
    from transformers.utils import import_utils

    version = getattr(import_utils, "KERNELS_MIN_VERSION", "0.18.2")
    dist = tmp_path / f"kernels-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n")
    script = (
        "import importlib.util, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(TINY_CHECKPOINT)!r})\n"
        "with torch.no_grad():\n"
        "    logits = model(torch.tensor([[1, 2, 3]])).logits\n"
        "print(tuple(logits.shape), importlib.util.find_spec('kernels'))\n"
    )
    out = _run([sys.executable, "-c", script], cwd=REPO,
               env=_clean_env(PYTHONPATH=str(tmp_path), HF_HUB_OFFLINE="1"))
    shape, spec = out.strip().splitlines()[-1].split(") ", 1)
    assert shape.startswith("(1, 3, ") and spec == "None"
