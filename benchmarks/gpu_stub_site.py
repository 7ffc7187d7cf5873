"""The machine's packages that still work under the stub's numpy, as a folder of links.

The Triton 2.51 stub needs numpy 1 (`mla_backend/serving/stub_check.py`), so `gpu_env.sh` puts
numpy 1.26.4 ahead of the GPU machine's own packages. Some of those packages need numpy 2 (the
image's SciPy requires numpy >= 2.0, and scikit-learn needs SciPy); transformers imports
scikit-learn whenever it can find it (5.17's `generation/candidate_generator.py`), so
`from transformers import AutoTokenizer` then fails. This script links every top-level entry of
the machine's site-packages into DEST, except the files of the distributions whose
`Requires-Dist` excludes NUMPY_VERSION, directly or through another excluded distribution (and
numpy itself). Run it with the machine's `python3` (it needs `packaging`):

    python3 benchmarks/gpu_stub_site.py IMAGE_SITE DEST NUMPY_VERSION [NAME ...]

NAMEs are distributions to leave out as well, with what needs them (for one whose metadata does
not say which numpy it needs). Prints the excluded distributions. Entries no distribution owns
are linked.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def excluded_distributions(site: str, numpy_version: str, also: list[str]
                           ) -> dict[str, md.Distribution]:
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
    out = {canonicalize_name(n) for n in also} & dists.keys()
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


def owned_entries(dist: md.Distribution) -> set[str]:
    """The top-level entries of site-packages that hold `dist`'s files."""
    entries = set()
    for f in dist.files or []:
        top = Path(str(f)).parts[0]
        if top not in ("..", "/"):
            entries.add(top)
    return entries


def main(argv: list[str]) -> int:
    site, dest, numpy_version, *also = argv
    out = excluded_distributions(site, numpy_version, also)
    skip: set[str] = set()
    for dist in out.values():
        skip |= owned_entries(dist)
    os.makedirs(dest, exist_ok=True)
    for entry in sorted(os.listdir(site)):
        if entry not in skip and entry != "__pycache__":
            os.symlink(os.path.join(site, entry), os.path.join(dest, entry))
    print("stub site: left out (need another numpy): "
          + ", ".join(f"{n} {d.version}" for n, d in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
