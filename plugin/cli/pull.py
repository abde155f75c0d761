"""`loom pull PRESET`: download the weights a preset needs into the Hugging Face cache.

Through `huggingface_hub` (the `pull` extra): each file shows a progress bar, an interrupted
download resumes where it stopped, every file is checked against the checksum the hub gave for it,
and a file already cached is not fetched again. With `--offline` (or `HF_HUB_OFFLINE=1`) nothing
is fetched: the command says what is cached and what is missing. Once pulled, the preset finds
the files by itself (engine.models.weights); a path given with `--set` still wins.

Before the first download the hub is asked once, without the client's retries: with no network,
huggingface_hub retries each request for about 24 s before it gives up.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from loom_live.engine.config import list_presets, load_config
from loom_live.engine.models.weights import (
    PRESET_WEIGHTS,
    PULLABLE_PRESETS,
    WeightSource,
    cached_path,
    hub_cache_dir,
    pull_list,
    pull_list_path,
    weight_sources,
)
from loom_live.host_bridge.wire.errors import UserError
from loom_live.host_bridge.wire.files import write_replacing
from loom_live.host_bridge.wire.typed_config import did_you_mean

log = logging.getLogger(__name__)
HASH_CHUNK = 1 << 22


class NotPulled(UserError):
    """A source the cache lacks, offline: counted with the others, said in one line at the end."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download the weights a preset needs (Hugging Face; pip install 'loom-live[pull]')",
                       description="Fetch a preset's weights into the Hugging Face cache (HF_HUB_CACHE / HF_HOME); "
                                   "the preset then finds them with no --set.")
    p.add_argument("preset", metavar="PRESET", nargs="?",
                   help=f"preset or YAML file whose weights to fetch ({', '.join(PULLABLE_PRESETS)}); with --list "
                        "and none, every preset's")
    p.add_argument("--offline", action="store_true",
                   help="fetch nothing: report what is cached and fail if anything is missing (also HF_HUB_OFFLINE=1)")
    p.add_argument("--list", action="store_true", dest="list_only",
                   help="list the repositories, files and licences without fetching")
    p.set_defaults(func=run)


def sources_for(preset: str) -> tuple[WeightSource, ...]:
    """The weight sources of a preset name or YAML file (by its model.preset)."""
    check_preset_name(preset)
    cfg = load_config(preset)
    sources = weight_sources(cfg)
    if not sources:
        what = f"edit.unet {cfg.edit.unet!r}" if cfg.model.family == "edit" else f"model.preset {cfg.model.preset!r}"
        raise UserError(f"preset {preset!r} ({what}) needs no download: its weights are embedded or seeded; "
                        f"presets with weights to pull: {', '.join(PULLABLE_PRESETS)}")
    return sources


def check_preset_name(preset: str) -> None:
    """A name that is neither a preset nor a YAML file is refused in pull's words: the presets listed are those
    with weights to fetch (the config's list named `default` and `tiny-random`, which then need no download),
    and a Hugging Face repository id (`org/name`) is answered with how its files are given instead."""
    path = Path(preset).expanduser()
    if preset in list_presets() or path.suffix.lower() in (".yaml", ".yml") or path.exists():
        return  # the config says what is wrong with one of these
    pullable = ", ".join(PULLABLE_PRESETS)
    if "/" in preset:
        keys = ", ".join(dict.fromkeys(s.key for sources in PRESET_WEIGHTS.values() for s in sources))
        raise UserError(f"{preset!r}: loom pull takes a preset name, not a repository id; presets with weights to "
                        f"pull: {pullable} (or a YAML file built on one; `loom pull --list` shows the repositories "
                        "each fetches). To run on a repository's files, download them yourself and give each with "
                        f"--set KEY=PATH (keys: {keys})")
    raise UserError(f"unknown preset {preset!r}{did_you_mean(preset, PULLABLE_PRESETS)}; presets with weights to "
                    f"pull: {pullable} (or a YAML file built on one)")


def run(args: argparse.Namespace) -> int:
    if args.preset is None:
        if not args.list_only:
            raise UserError(f"which preset? one of {', '.join(PULLABLE_PRESETS)} (or a YAML file built "
                            "on one); --list alone lists what each fetches")
        for preset in PULLABLE_PRESETS:
            print(f"{preset}:")
            _list(sources_for(preset))
        return 0
    sources = sources_for(args.preset)
    for notice in dict.fromkeys(s.notice for s in sources if s.notice):
        print(f"loom pull: NOTE: {notice}", file=sys.stderr)
    if args.list_only:
        _list(sources)
        return 0
    offline = args.offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise UserError("loom pull needs huggingface_hub: pip install 'loom-live[pull]'") from None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    if not offline:
        _check_reachable(sources, endpoint)
    missing = []
    for source in sources:
        try:
            path = _pull(source, offline, endpoint)
        except NotPulled:
            if not offline:
                raise
            missing.append(source)  # offline: go on, so the one line names everything that is missing
            continue
        print(f"{source.key} = {path}  ({source.what}, {source.licence})")
    if missing:
        raise UserError(f"offline mode is on (--offline or HF_HUB_OFFLINE=1) and the cache ({hub_cache_dir()}) "
                        f"lacks {len(missing)} of {len(sources)} sources: "
                        + "; ".join(f"{s.key} ({s.what}, from {s.repo})" for s in missing)
                        + f"; run `loom pull {args.preset}` with network access")
    print(f"loom pull: {args.preset} is ready; it finds these files by itself (cache: {hub_cache_dir()})")
    return 0


def _list(sources: tuple[WeightSource, ...]) -> None:
    for s in sources:
        rev = f" (revision {s.revision})" if s.revision != "main" else ""
        print(f"{s.key:<18} {s.what}: https://huggingface.co/{s.repo}{rev} {', '.join(s.files)}  [{s.licence}]")


def _check_reachable(sources: tuple[WeightSource, ...], endpoint: str | None) -> None:
    """One request to the hub through its client (its proxies and certificates), within HF_HUB_ETAG_TIMEOUT: any
    answer will do; none is said at once, naming what could not be fetched."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(endpoint or constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as exc:  # the client's connection errors are neither OSError nor the hub's own
        raise _unreachable(sources, endpoint, exc) from None


def _pull(source: WeightSource, offline: bool, endpoint: str | None) -> Path:
    """Fetch (or, offline, find) every file of one source; returns what its config key points at."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        names = _repo_files(source, offline, endpoint)
        if names and any("*" in f for f in source.files):
            _list_pull(source, names, cache, endpoint)
        for name in names:
            path = _download(source, name, cache, endpoint, offline)
            if not offline:
                _verify(Path(path), source.repo, name)
    except LocalEntryNotFoundError:
        if offline:
            raise NotPulled(f"{source.repo}: not in the cache ({cache}) and offline mode is on "
                            "(--offline or HF_HUB_OFFLINE=1); run `loom pull` with network access") from None
        raise _unreachable((source,), endpoint) from None
    except HfHubHTTPError as exc:
        raise UserError(f"{source.repo}: the hub refused the download: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise UserError(f"{source.repo}: download failed: {exc}") from None
    path = cached_path(source, cache)
    if path is None:
        raise NotPulled(f"{source.repo}: the cache ({cache}) still lacks files of {', '.join(source.files)}")
    return path


def _repo_files(source: WeightSource, offline: bool, endpoint: str | None) -> list[str]:
    """The repository files a source's patterns name (a folder pattern is listed through the hub's API)."""
    if all("*" not in f for f in source.files):
        return list(source.files)
    if offline:
        snapshot = cached_path(source)
        if snapshot is None:
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError(source.repo)
        return []
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        listed = HfApi(endpoint=endpoint).list_repo_files(source.repo, revision=source.revision)
    except HfHubHTTPError:
        raise
    except Exception as exc:  # the hub client's own connection errors are neither OSError nor the hub's
        raise _unreachable((source,), endpoint, exc) from None
    names = [n for n in listed if any(fnmatch.fnmatch(n, pattern) for pattern in source.files)]
    if not names:
        raise UserError(f"{source.repo}: holds none of {', '.join(source.files)}")
    return names


def _list_pull(source: WeightSource, names: list[str], cache: Path, endpoint: str | None) -> None:
    """Write down, before fetching a folder, every name it holds at the commit about to be fetched: a pull
    stopped inside the folder (a tokenizer without its vocabulary) then does not pass for the whole of it."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        meta = get_hf_file_metadata(hf_hub_url(source.repo, names[0], revision=source.revision, endpoint=endpoint))
    except HfHubHTTPError:
        raise
    except Exception as exc:
        raise _unreachable((source,), endpoint, exc) from None
    if not meta.commit_hash:
        return
    snapshot = cache / f"models--{source.repo.replace('/', '--')}" / "snapshots" / meta.commit_hash
    listed = pull_list_path(snapshot)
    listed.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(sorted(set(names) | set(pull_list(snapshot))))
    write_replacing(listed, lambda f: f.write(text.encode()))


def _unreachable(sources: tuple[WeightSource, ...], endpoint: str | None,
                 exc: Exception | None = None) -> UserError:
    why = f": {type(exc).__name__}" if exc is not None else ""
    return UserError(f"{', '.join(dict.fromkeys(s.repo for s in sources))}: cannot reach the Hugging Face hub "
                     f"({endpoint or 'huggingface.co'}){why}; check the network, or set HF_ENDPOINT to a mirror, "
                     "or give the run local files instead of pulling: "
                     + " ".join(f"--set {key}=PATH" for key in dict.fromkeys(s.key for s in sources)))


def _download(source: WeightSource, name: str, cache: Path, endpoint: str | None, offline: bool) -> str:
    from huggingface_hub import hf_hub_download

    # hf_hub_download keeps a partial file (.incomplete) and resumes it, and skips a file already cached.
    return hf_hub_download(source.repo, name, revision=source.revision, cache_dir=cache, endpoint=endpoint,
                           local_files_only=offline)


def _verify(path: Path, repo: str, name: str) -> None:
    """The cache names each file by the hub's ETag: the SHA-256 of a large (LFS) file, the git blob SHA-1 of a
    small one. Recompute it, so a truncated or damaged download never passes for the real weights."""
    blob = path.resolve()
    expected = blob.name
    if len(expected) == 64:
        digest = hashlib.sha256()
    elif len(expected) == 40:
        digest = hashlib.sha1()
        digest.update(f"blob {blob.stat().st_size}\0".encode())
    else:
        log.warning("%s/%s: no checksum to verify against (etag %r)", repo, name, expected)
        return
    with open(blob, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        blob.unlink(missing_ok=True)
        raise UserError(f"{repo}/{name}: checksum mismatch (damaged download, removed); run `loom pull` again")
    print(f"  {repo}/{name}: checksum ok", file=sys.stderr)
