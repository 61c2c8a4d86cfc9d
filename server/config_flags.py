"""The `radixgen serve` flags that rebuild a Config: the inverse of server/cli.py's `config_from_args`, used
to start the worker servers of `--dp-size` (server/dp.py) with the supervisor's own settings."""

from __future__ import annotations

import dataclasses

from runtime.config import Config


def config_flags(cfg: Config) -> list[str]:
    """The `radixgen serve` flags that rebuild `cfg` (fields at their default are left out): the inverse of
    `config_from_args`, used to start the worker servers of `--dp-size`."""
    out: list[str] = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        for f in dataclasses.fields(part):
            value, default = getattr(part, f.name), f.default
            if value == default or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            else:
                out += [flag, str(value)]
    return out
