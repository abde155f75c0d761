"""What a host says of an engine's config in `--set` lines and options, checked in the host's own words.

A host attached to an engine served with its own config may tell it only its live parameters and a first prompt
(`served_overrides`); a host that launches its engine and whose user has no command line (ComfyUI's Engine node)
checks the config and its lines before the engine starts (`check_overrides`); the player's `--lora`, `--control` and
`--reference` options become `--set` lines (`lora_override`, `control_override`). The config itself, and how a file
and its overrides are read, are engine.config's.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

from loom_live.engine.config import LoomConfig, check_prompt_text, overridden_source, override_value
from loom_live.host_bridge.wire import params as live
from loom_live.host_bridge.wire.typed_config import ConfigError, apply_override, build, did_you_mean, parse_override

# the `--set` keys a host attached to an engine served with its own config (`--endpoint`) keeps for itself: its first
# prompt (the engine is sent it as a prompt)
HOST_KEYS = ("prompt.text",)


def served_keys() -> dict[str, live.LiveParam]:
    """Each live parameter of every model family by its config key (section.name; the LoRAs' scales: `lora`): the
    `--set` keys that reach an engine served with its own config."""
    return {p.section if p is live.LORA_SCALES else f"{p.section}.{p.name}": p for p in live.LIVE}


def served_overrides(overrides: list[str] | tuple[str, ...],
                     sources: list[str] | None = None) -> tuple[list[str], dict[str, Any]]:
    """`--set key=value` overrides of a host attached to an engine served with its own config (`--endpoint`), split
    into those the host keeps for its own config (`HOST_KEYS`) and the live parameters they set, by name as the wire
    takes them, of whichever model family (`served_keys`: the served engine's is not -c's), each checked as its config
    section checks it; the engine is told those it takes once it says which. Any other key never reaches a served
    engine, which runs its own config: ServedKeyError names it and what may be set. A value that is not allowed is
    named by its override's entry of `sources` (a host whose user has no command line: its own input's words, as
    ComfyUI's `overrides line 2`), or else in the command line's words (`--set`)."""
    host: list[str] = []
    data: dict[str, Any] = {}
    where: dict[str, str] = {}  # each live key by the source of the override that set it last (the one that counts)
    keys, hints = served_keys(), typing.get_type_hints(LoomConfig)
    for number, text in enumerate(overrides):
        source = sources[number] if sources is not None else None
        path, raw = parse_override(text)
        for leaf, value in _leaves(path, override_value(path, raw, source or f"--set {text}")):
            key = ".".join(leaf)
            if key in HOST_KEYS:  # checked here, so that a refusal names its source as a live value's does
                build(hints[leaf[0]], {leaf[1]: value}, source=source or "--set", path=leaf[0])
                host.append(f"{key}={json.dumps(value, ensure_ascii=False)}")  # YAML reads JSON text
            elif key in keys:
                apply_override(data, leaf, value)
                where[key] = source or "--set"
            else:
                raise ServedKeyError(text, key, list(keys))
    return host, _checked_live(data, where, hints)


class ServedKeyError(ConfigError):
    """`served_overrides`' refusal of a key no served engine reads, in the command line's words (`--set`,
    `--endpoint`); a host whose user has no command line (ComfyUI's Engine node) says the same from its fields in
    its own inputs' words."""

    def __init__(self, override: str, key: str, live_keys: list[str]) -> None:
        self.override, self.key, self.live_keys = override, key, live_keys
        self.hint = did_you_mean(key, [*live_keys, *HOST_KEYS])
        super().__init__(f"--set {override}: a served engine (--endpoint) runs its own config, and only the live "
                         f"parameters reach it ({', '.join(live_keys)}) and {', '.join(HOST_KEYS)}{self.hint}; set "
                         f"{key} where it is served (loom serve --set {key}=...), or leave out --endpoint")


def _leaves(path: list[str], value: Any) -> list[tuple[list[str], Any]]:
    """The keys an override sets, each with its value: a section written whole (`noise={noise_scale: 0.5}`) sets
    each key it holds."""
    if not isinstance(value, dict) or not value:
        return [(path, value)]
    return [leaf for key, inner in value.items() for leaf in _leaves([*path, str(key)], inner)]


def _checked_live(data: dict[str, Any], where: dict[str, str], hints: dict[str, Any]) -> dict[str, Any]:
    """Live parameters by config section (`served_overrides`) as the wire takes them, each checked as its config
    section checks it (the LoRA list: its names distinct), alone, so that a refusal names where it was set (`where`,
    by key): no live parameter's allowed values depend on another's."""
    params = {}
    for section, values in data.items():
        if section == live.LORA_SCALES.section:
            entries = build(LoomConfig, {section: values}, source=where[section]).lora
            params[live.LORA_SCALES.name] = {e.key: e.scale for e in entries}
            continue
        for name, value in values.items():
            built = build(hints[section], {name: value}, source=where[f"{section}.{name}"], path=section)
            params[name] = live.LIVE[name].check(getattr(built, name))
    return params


def lora_override(specs: list[str]) -> list[str]:
    """`--lora PATH[:SCALE]` options as one `--set lora=[...]` override (none given: none)."""
    entries = []
    for text in specs:
        path, sep, tail = text.rpartition(":")
        try:
            scale = float(tail) if sep else live.LORA_DEFAULT_SCALE
        except ValueError:  # a colon of the path itself (C:\\...), no scale
            if Path(path).expanduser().is_file() and not Path(text).expanduser().exists():  # not "no such file"
                raise ConfigError(f"--lora {text}: the scale {tail!r} is not a number; expected PATH[:SCALE], "
                                  f"e.g. {path}:0.8") from None
            path, scale = text, live.LORA_DEFAULT_SCALE
        entries.append({"path": path if sep and path else text, "scale": scale})
    # not ASCII-escaped: YAML reads an escaped emoji (a path may hold one) as two broken halves
    return [f"lora={json.dumps(entries, ensure_ascii=False)}"] if entries else []


def control_override(control: str | None, reference: str | None) -> list[str]:
    """`--control edges|grey|flow|depth|FILE` and `--reference IMAGE` as `--set` overrides (a FILE is a control
    video the engine reads beside the input; paths made absolute, the engine may run elsewhere)."""
    def absolute(path: str) -> str:
        return json.dumps(str(Path(path).expanduser().resolve()))

    out = []
    if control in live.CONTROL_SOURCES and control != "video":
        out.append(f"control.control_source={control}")
    elif control:
        out += ["control.control_source=video", f"control.video={absolute(control)}"]
    if reference:
        out.append(f"control.reference={absolute(reference)}")
    return out


def check_overrides(name_or_path: str | Path | None, overrides: list[str], sources: list[str], label: str) -> None:
    """A config with overrides checked as an engine checks it when it starts (the weights it would look up aside),
    for a host that launches engines and whose user has no command line (ComfyUI's Engine node): said at once in the
    host's own words instead of by the engine after its start, in `--set` words. An override that is not YAML is named
    by its entry of `sources`; a value the config does not allow is named by the first override after which the
    config is refused as it is with all of them (a refusal that a later override only changes is not blamed on an
    earlier one), and else by the config's `label`."""
    def refused(count: int) -> tuple[str, str] | None:
        """The refusal with the first `count` overrides: whole, and without the config's name (which says how many
        overrides it holds)."""
        source = ""
        try:
            data, source = overridden_source(name_or_path, overrides[:count], sources, label)
            check_prompt_text(data, source)
            build(LoomConfig, data, source=source)
        except ConfigError as exc:
            return str(exc), str(exc).removeprefix(f"{source}: ")
        return None

    whole = refused(len(overrides))
    if whole is None:
        return
    first = next(n for n in range(len(overrides) + 1) if (refused(n) or ("", ""))[1] == whole[1])
    if not first or whole[0].startswith(f"{sources[first - 1]}: "):
        raise ConfigError(whole[0])
    raise ConfigError(f"{sources[first - 1]}: {whole[1]}")
