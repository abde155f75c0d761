"""The edit family's live parameters: names, ranges and where each lives in the config.

One place for these facts until the shared schema (host_bridge/wire/params.py) takes them: the
values are validated exactly as the config file's `edit` and `slo` sections are, so a live
change and a YAML file refuse the same things with the same message.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.config import LoomConfig

# live name -> (config section, key); the same names as the config keys they change
LIVE_PARAMS: dict[str, tuple[str, str]] = {
    "adapter_strength": ("edit", "adapter_strength"),
    "cond_refresh_every": ("edit", "cond_refresh_every"),
    "prompt_refresh_every": ("edit", "prompt_refresh_every"),
    "target_fps": ("slo", "target_fps"),  # shared with the Wan family: the same meaning
    "latency_budget_ms": ("slo", "latency_budget_ms"),
}


def apply_params(cfg: LoomConfig, params: dict[str, Any]) -> LoomConfig:
    """The config with these live changes, validated; ValueError names an unknown or bad one."""
    from host_bridge.wire.typed_config import build

    unknown = [k for k in params if k not in LIVE_PARAMS]
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r}; settable: {', '.join(LIVE_PARAMS)}")
    new = cfg
    for section in dict.fromkeys(s for s, _ in LIVE_PARAMS.values()):
        changed = {LIVE_PARAMS[k][1]: v for k, v in params.items() if LIVE_PARAMS[k][0] == section}
        if changed:
            data = {**getattr(new, section).__dict__, **changed}
            new = replace(new, **{section: build(type(getattr(new, section)), data, source="set_params",
                                                 path=section)})
    return new
