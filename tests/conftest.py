"""Keep every cache and temporary file inside the working tree, offline, before any HF import."""

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parents[1]
for _name, _sub in (("HF_HOME", ".cache/hf"), ("TMPDIR", ".cache/tmp"), ("HF_POWERNORM_CACHE", ".cache/kernels")):
    _path = _ROOT / _sub
    _path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(_name, str(_path))
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

import tempfile  # noqa: E402

tempfile.tempdir = os.environ["TMPDIR"]
