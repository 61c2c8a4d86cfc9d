"""int8 calibration records kept on disk, so a restart of --quantization w8a8_int8 skips calibration's forwards.

Calibration (runtime/models/int8_calibration.py) records each int8 linear's largest |input| per channel over text
the model writes itself: two float32 forward passes, most of the mode's start-up cost. The record is a function of
the key below alone (the model file, calibration's constants, the model and kernel code, torch, the CPU), so it is
kept in the artifact cache (runtime/executor/artifact_cache.py) as one safetensors file, module name -> float32
[in_features]. An entry is trusted only when the cache's checks pass (key equal, sha256 of the file) and its
content is what these linears take: exactly their names, each a finite, non-negative float32 vector of its
linear's length. Anything else is removed, counted as rejected, and calibration runs again. A cache that cannot
be written costs one warning; the record computed stays in use.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.executor import aot_graph
from runtime.executor.artifact_cache import ArtifactCache
from runtime.models import int8_calibration as cal

log = logging.getLogger(__name__)

FORMAT = "int8-calibration-1"
PAYLOAD = "calibration.safetensors"


def calibration_key(model_path: str, quantization_group_size: int) -> dict[str, Any]:
    """Every input the record depends on."""
    return {"format": FORMAT, "model": aot_graph.file_identity(model_path),
            "quantization_group_size": quantization_group_size, "classes": sorted(cal.INT8_CLASSES),
            "seeds": list(cal.SEED_TOKENS), "tokens": cal.CALIBRATION_TOKENS, "code": aot_graph.code_hash(),
            "torch": torch.__version__, "cpu": aot_graph.cpu_flags()}


def check_record(amax: dict[str, torch.Tensor], shapes: dict[str, int]) -> str | None:
    """None when `amax` fits the linears `shapes` (name -> in_features), else why not."""
    if set(amax) != set(shapes):
        return f"names differ ({len(amax)} stored, {len(shapes)} linears)"
    for name, n in shapes.items():
        t = amax[name]
        if t.dtype != torch.float32 or tuple(t.shape) != (n,):
            return f"{name}: {t.dtype} {tuple(t.shape)}, expected float32 ({n},)"
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            return f"{name}: values not finite and non-negative"
    return None


class CalibrationStore:
    """cal.AmaxStore over an ArtifactCache entry; `source` says where the record in use came from: "cache" or
    "computed" (plus "; not stored: why" when saving failed)."""

    def __init__(self, cache: ArtifactCache, key: dict[str, Any]) -> None:
        self.cache, self.key = cache, key
        self.source = "computed"

    def load(self, shapes: dict[str, int]) -> dict[str, torch.Tensor] | None:
        found = self.cache.lookup(self.key)
        if found is None:
            return None
        try:
            amax = load_file(str(found))
        except (OSError, SafetensorError) as e:
            self.cache.discard(self.key, f"unreadable record: {type(e).__name__}")
            return None
        why = check_record(amax, shapes)
        if why is not None:
            self.cache.discard(self.key, why)
            return None
        self.source = "cache"
        return amax

    def save(self, amax: dict[str, torch.Tensor]) -> None:
        try:
            self.cache.root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.cache.root, prefix=".tmp-") as tmp:
                path = Path(tmp) / PAYLOAD
                save_file({n: t.contiguous() for n, t in amax.items()}, str(path))
                self.cache.store(self.key, path)
        except OSError as e:
            self.source = f"computed; not stored: {type(e).__name__}: {e}"
            log.warning("int8 calibration record not stored in %s (%s); the next start calibrates again",
                        self.cache.root, e)


def calibration_store(model_path: str, quantization_group_size: int, cache_root: str | None,
                      max_bytes: int) -> CalibrationStore:
    cache = ArtifactCache(cache_root, max_bytes, payload=PAYLOAD, label="int8 calibration cache")
    return CalibrationStore(cache, calibration_key(model_path, quantization_group_size))
