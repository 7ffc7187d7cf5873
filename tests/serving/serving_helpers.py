"""Helpers shared by the end-to-end serving tests (no tests here).

- `write_model`: a copy of one of our model folders (config.pbtxt + 1/model.py) in a temporary
  model repository, renamed, with engine parameters overridden and `model_path` pointing at the
  real weights folder (made by `mla_tools.prepare` if missing).
- `read_metrics` / `series`: the Prometheus text of a server's metrics port as numbers.
- `pbtxt_parameters` / `engine_config`: a written config.pbtxt's parameters, and the
  EngineConfig the adapter builds from them (for in-process engines with the server's settings).
- `gauges` / `wait_gauges`: a model's running / waiting / KV-usage gauges, and a wait until they
  reach given values.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import requests

from mla_tools.prepare import DEFAULT_MODEL_REPOSITORY, prepare

REPO = Path(__file__).resolve().parents[2]


def _set_param(text: str, key: str, value: str, add: bool = False) -> str:
    pattern = rf'(\{{\s*key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*)"[^"]*"'
    new, n = re.subn(pattern, rf'\g<1>"{value}"', text)
    if n == 0 and add:  # append to the parameters list (its last entry has no comma)
        entry = f'{{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        new, n = re.subn(r"(\}\s*\})(\s*\]\s*)$", rf"\g<1>,\n  {entry}\g<2>", text)
    assert n == 1, f"config.pbtxt has no single parameter {key!r}"
    return new


def write_model(root: Path, name: str, params: dict[str, str],
                source: str = "deepseek-v2-tiny", instances: int = 1,
                extra_params: dict[str, str] | None = None, kind: str = "KIND_CPU") -> None:
    """Write model `name` into repository `root` as a copy of model_repository/<source>.

    Args:
        params: config.pbtxt parameters to override (values as strings); `model_path`
            defaults to the source's weights folder (absolute).
        instances: `count` of the instance group.
        extra_params: parameters to set, appended when the source config.pbtxt lacks them.
        kind: the instance group's kind (KIND_CPU; KIND_MODEL or KIND_GPU on a GPU machine).
    Raises:
        AssertionError: the source config.pbtxt lacks a parameter of `params` or the instance
            group.
    """
    prepare(DEFAULT_MODEL_REPOSITORY, models=[source])
    src = REPO / "model_repository" / source
    (root / name / "1").mkdir(parents=True)
    shutil.copy(src / "1" / "model.py", root / name / "1" / "model.py")
    text = (src / "config.pbtxt").read_text()
    text = re.sub(r'^name: "[^"]*"', f'name: "{name}"', text, count=1, flags=re.M)
    text, n = re.subn(r"instance_group \[ \{ kind: KIND_CPU, count: 1 \} \]",
                      f"instance_group [ {{ kind: {kind}, count: {instances} }} ]", text)
    assert n == 1, "config.pbtxt has no single KIND_CPU instance_group"
    for key, value in {"model_path": str(src / "weights"), **params}.items():
        text = _set_param(text, key, value)
    for key, value in (extra_params or {}).items():
        text = _set_param(text, key, value, add=True)
    (root / name / "config.pbtxt").write_text(text)


def read_metrics(server) -> dict[tuple[str, str], float]:
    """(series name, label text) → value, from the Prometheus text on the metrics port."""
    text = requests.get(server.metrics_url, timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def series(metrics: dict[tuple[str, str], float], name: str, model: str,
           **labels: str) -> float | None:
    """Value of series `name` for `model` (and the given labels); None when absent."""
    for (n, lab), v in metrics.items():
        if n != name or f'model="{model}"' not in lab:
            continue
        if all(f'{k}="{val}"' in lab for k, val in labels.items()):
            return v
    return None


IDLE = {"running": 0.0, "waiting": 0.0, "kv": 0.0}  # cached-but-evictable slots count as free


def gauges(server, model: str) -> dict[str, float]:
    """running / waiting / kv of `model` from the metrics port (absent series: -1)."""
    metrics = read_metrics(server)
    out = {}
    for key, name in (("running", "mla_backend:num_requests_running"),
                      ("waiting", "mla_backend:num_requests_waiting"),
                      ("kv", "mla_backend:kv_cache_usage_ratio")):
        value = series(metrics, name, model)
        out[key] = -1.0 if value is None else value
    return out


def wait_gauges(server, model: str, want: dict[str, float], timeout_s: float = 30.0) -> None:
    """Wait until `model`'s gauges equal `want` (a subset of running / waiting / kv).

    Raises:
        AssertionError: not within `timeout_s` (the last values in the message).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = gauges(server, model)
        if all(got[k] == v for k, v in want.items()):
            return
        assert time.monotonic() < deadline, f"{model}: gauges {got}, want {want}"
        time.sleep(0.1)


def pbtxt_parameters(config: Path) -> dict[str, str]:
    """key → string_value of every `parameters` entry of a config.pbtxt."""
    pattern = r'\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}'
    return dict(re.findall(pattern, config.read_text()))


def engine_config(model_dir: Path):
    """The EngineConfig the adapter builds for the model in `model_dir` (its config.pbtxt;
    `model_path` relative to the folder)."""
    from mla_backend.config import EngineConfig
    from mla_backend.serving.protocol import ADAPTER_PARAMETERS

    return EngineConfig.from_parameters(pbtxt_parameters(model_dir / "config.pbtxt"),
                                        base_dir=str(model_dir), ignore=ADAPTER_PARAMETERS)
