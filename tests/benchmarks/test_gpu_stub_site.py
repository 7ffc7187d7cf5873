"""benchmarks/gpu_stub_site.py: which of a machine's packages the stub's numpy-1 venv may see, on
a site-packages folder made here (dist-info metadata as pip writes it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_stub_site.py"


def _dist(site: Path, name: str, version: str, top: str, requires: list[str]) -> None:
    """A distribution whose files are the package folder `top` (may be nested: "nvidia/x")."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    (site / top).mkdir(parents=True)
    (site / top / "__init__.py").write_text("")
    (info / "RECORD").write_text(f"{top}/__init__.py,,\n{info.name}/METADATA,,\n"
                                 f"{info.name}/RECORD,,\n")


def _run(site: Path, dest: Path) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), str(site), str(dest), "1.26.4"],
                         capture_output=True, text=True, check=True)
    return out.stdout


def test_leaves_out_what_needs_numpy_2_and_what_needs_that(tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "numpy", "2.5.2", "numpy", [])
    _dist(site, "scipy", "1.18.1", "scipy", ["numpy<2.8,>=2.0.0"])
    _dist(site, "scikit-learn", "1.9.1", "sklearn", ["numpy>=1.22", "scipy>=1.10"])
    _dist(site, "transformers", "5.17.0", "transformers",
          ["numpy>=1.17", "scipy; extra == 'sklearn'"])
    _dist(site, "torch", "2.11.0", "torch", ["numpy; extra == 'opt-einsum'"])
    (site / "distutils-precedence.pth").write_text("import os\n")
    dest = tmp_path / "dest"
    printed = _run(site, dest)
    assert "numpy 2.5.2, scikit-learn 1.9.1, scipy 1.18.1" in printed
    linked = sorted(p.name for p in dest.iterdir())
    assert linked == ["distutils-precedence.pth", "torch", "torch-2.11.0.dist-info",
                      "transformers", "transformers-5.17.0.dist-info"]
    assert (dest / "torch").resolve() == (site / "torch").resolve()


def test_a_namespace_folder_keeps_the_kept_distributions_files(tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "nvidia-cudnn-cu13", "9.0", "nvidia/cudnn", [])
    _dist(site, "nvidia-tool", "1.0", "nvidia/tool", ["numpy>=2"])
    _dist(site, "jax", "0.11.2", "jax", ["numpy>=2.0"])
    dest = tmp_path / "dest"
    assert "jax 0.11.2, nvidia-tool 1.0" in _run(site, dest)
    assert not (dest / "nvidia").is_symlink() and (dest / "nvidia").is_dir()
    assert sorted(p.name for p in (dest / "nvidia").iterdir()) == ["cudnn"]
    assert (dest / "nvidia" / "cudnn" / "__init__.py").is_file()
    assert not (dest / "jax").exists() and not (dest / "jax-0.11.2.dist-info").exists()
