"""The tensor-parallel step message (runtime/executor/tp.py): a msgspec header and one int64 tensor, no pickle.

Round trip of `pack_step` / `unpack_step`, then two real gloo ranks on 127.0.0.1 exchanging steps with every
pickle entry point made to raise (tests.runtime.executor.tp_step_rank.py): what rank 1 receives equals what rank 0 sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from runtime.executor.tp import STOP, pack_step, unpack_step
from tests.runtime.executor.tp_step_rank import as_json, steps
from tests.server.harness import ROOT, free_port


def test_pack_unpack_round_trip():
    for fb, rows in steps():
        header, data = pack_step(fb, rows)
        assert isinstance(header, bytes) and data.dtype == torch.int64 and data.dim() == 1
        fb2, rows2 = unpack_step(header, data)
        assert as_json(fb2, rows2) == as_json(fb, rows)
    from runtime.executor.tp import _ENC

    assert unpack_step(_ENC.encode(STOP), torch.zeros(0, dtype=torch.int64)) is None


def test_two_ranks_exchange_steps_without_pickle():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "tests.runtime.executor.tp_step_rank"]
    procs = [subprocess.Popen([*cmd, str(r), str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    received = json.loads(outs[1][0].strip().splitlines()[-1])
    assert received == [as_json(*s) for s in steps()] + [None]
