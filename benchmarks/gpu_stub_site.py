"""The machine's packages that still work under the stub's numpy, as a folder of links.

The Triton 2.51 stub needs numpy 1 (`mla_backend/serving/stub_check.py`), so `gpu_env.sh` puts
numpy 1.26.4 ahead of the GPU machine's own packages. Some of those packages need numpy 2 (the
image's SciPy requires numpy >= 2.0, and scikit-learn needs SciPy); transformers imports
scikit-learn whenever it can find it (5.17's `generation/candidate_generator.py`), so
`from transformers import AutoTokenizer` then fails. This script links the entries of the
machine's site-packages into DEST, except the files of the distributions whose `Requires-Dist`
excludes NUMPY_VERSION, directly or through another excluded distribution (and numpy itself); a
folder shared by excluded and kept distributions (a namespace such as nvidia/) is made in DEST
and its entries linked the same way. Run it with the machine's `python3` (it needs `packaging`):

    python3 benchmarks/gpu_stub_site.py IMAGE_SITE DEST NUMPY_VERSION

Prints the excluded distributions. Entries no distribution owns are linked.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from pathlib import PurePosixPath

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def excluded_distributions(site: str, numpy_version: str) -> dict[str, md.Distribution]:
    """Distributions of `site` that cannot run with numpy `numpy_version` (by name), and numpy
    itself (the stub's numpy replaces it)."""
    dists = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions(path=[site])
             if d.metadata["Name"]}
    needs: dict[str, list[Requirement]] = {}
    for name, dist in dists.items():
        reqs = []
        for text in dist.requires or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                reqs.append(req)
        needs[name] = reqs
    numpy = Version(numpy_version)
    out: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, reqs in needs.items():
            if name in out:
                continue
            for req in reqs:
                dep = canonicalize_name(req.name)
                if (dep == "numpy" and not req.specifier.contains(numpy, prereleases=True)) \
                        or dep in out:
                    out.add(name)
                    changed = True
                    break
    return {name: dists[name] for name in sorted(out | ({"numpy"} & dists.keys()))}


def files_of(dist: md.Distribution) -> set[PurePosixPath]:
    """`dist`'s files inside site-packages (RECORD paths; those outside it left out)."""
    out = set()
    for f in dist.files or []:
        path = PurePosixPath(str(f))
        if path.parts and path.parts[0] not in ("..", "/"):
            out.add(path)
    return out


def parents(paths: set[PurePosixPath]) -> set[PurePosixPath]:
    """Every folder (relative, not ".") that holds one of `paths`."""
    return {parent for p in paths for parent in p.parents if parent != PurePosixPath(".")}


def link_site(site: str, dest: str, excluded: set[PurePosixPath],
              kept: set[PurePosixPath]) -> None:
    """Links in `dest` to the entries of `site`, less the `excluded` files: a folder that holds
    excluded files and no `kept` ones is left out; one that holds both (a namespace folder such
    as nvidia/) becomes a real folder whose entries are linked the same way."""
    excluded_dirs, kept_dirs = parents(excluded), parents(kept)

    def walk(rel: PurePosixPath) -> None:
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for entry in sorted(os.listdir(os.path.join(site, rel))):
            path = rel / entry
            if entry == "__pycache__" or path in excluded:
                continue
            if path in excluded_dirs:
                if path in kept_dirs:
                    walk(path)
                continue
            os.symlink(os.path.join(site, path), os.path.join(dest, path))

    walk(PurePosixPath("."))


def main(argv: list[str]) -> int:
    site, dest, numpy_version = argv
    out = excluded_distributions(site, numpy_version)
    excluded: set[PurePosixPath] = set()
    for dist in out.values():
        excluded |= files_of(dist)
    kept: set[PurePosixPath] = set()
    for dist in md.distributions(path=[site]):
        if dist.metadata["Name"] and canonicalize_name(dist.metadata["Name"]) not in out:
            kept |= files_of(dist)
    link_site(site, dest, excluded, kept - excluded)
    print("stub site: left out (need another numpy): "
          + ", ".join(f"{n} {d.version}" for n, d in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
