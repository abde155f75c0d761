"""The edit family's live parameters: its own (section `edit` of the shared schema) and the shared
ones that mean the same thing here (the latency budget and FPS target, section `slo`).

The facts (ranges, defaults) live in host_bridge/wire/params.py; the values are validated exactly
as the config file's sections are, so a live change and a YAML file refuse the same things with
the same words. Parameters of the Wan family (steps, noise, ...) have no meaning here and are
refused by name.
"""

from __future__ import annotations

from typing import Any

from loom_live.engine.config import LoomConfig
from loom_live.host_bridge.wire.params import EDIT_PARAMS, LATENCY_BUDGET_MS, TARGET_FPS

SETTABLE = (*EDIT_PARAMS, TARGET_FPS, LATENCY_BUDGET_MS)


def apply_params(cfg: LoomConfig, params: dict[str, Any]) -> LoomConfig:
    """The config with these live changes, validated; ValueError names an unknown or bad one."""
    return cfg.with_live(params, SETTABLE, family=" for the edit family")
