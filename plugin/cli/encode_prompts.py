"""`loom encode-prompts`: precompute prompt embeddings on a machine that has the text encoder.

The result is a safetensors file that `prompt.encoder: file` reads, so a show machine needs
neither transformers nor the 11 GB umT5 weights, only the prompts it will use. The encoders (and
torch) are imported only when this subcommand runs: `loom` builds every subcommand's parser on
each call, and `loom play` or `loom serve --passthrough` must not pay for torch in the player.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from loom_live.plugin.cli.common import positive_int

if TYPE_CHECKING:
    from loom_live.engine.stream.prompts import TextEncoder


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("encode-prompts", help="precompute prompt embeddings into a file (prompt.encoder: file)")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--from-file", type=Path, help="a text file with one prompt per line")
    p.add_argument("--encoder", choices=("umt5", "hash"), default="umt5",
                   help="umt5: the real text encoder (needs --encoder-path); hash: the small deterministic one")
    p.add_argument("--encoder-path", help="local umT5 directory (tokenizer and encoder weights)")
    p.add_argument("--dim", type=positive_int, default=4096,
                   help="embedding width for --encoder hash (default 4096)")
    p.add_argument("--device", default="cpu",
                   help="where the encoder runs: auto, cpu, cuda or cuda:N, as model.device (default cpu)")
    p.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    p.add_argument("-y", "--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=run)


def write_embeddings(encoder: TextEncoder, prompts: list[str], out: Path) -> None:
    from safetensors.torch import save

    from loom_live.engine.stream.prompts import FILE_KEY_PREFIX, check_prompt, prompt_key
    from loom_live.host_bridge.wire.files import write_replacing

    texts = list(dict.fromkeys(check_prompt(p) for p in prompts))
    tensors, names = {}, {}
    for i, text in enumerate(texts, 1):
        key = prompt_key(text)
        tensors[FILE_KEY_PREFIX + key] = encoder.encode([text])[0].contiguous()
        names[key] = text
        print(f"[{i}/{len(texts)}] {text}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = save(tensors, metadata={"prompts": json.dumps(names)})
    write_replacing(out, lambda f: f.write(data))  # the target is replaced whole, or left as it was


def check_out(out: Path, from_file: Path | None, overwrite: bool) -> None:
    """Refuse an --out that would destroy what the user has: a folder, the prompt list itself, any file
    without --overwrite; and one a `prompt.encoder: file` config would not read (not .safetensors)."""
    from loom_live.host_bridge.wire.errors import UserError

    if out.suffix.lower() != ".safetensors":
        raise UserError(f"--out {out}: an embeddings file ends in .safetensors")
    if out.is_dir():
        raise UserError(f"--out {out}: is a folder; give a file in it, such as {out / 'prompts.safetensors'}")
    if from_file is not None and out.exists() and from_file.exists() and os.path.samefile(out, from_file):
        raise UserError(f"--out {out} is the --from-file prompt list; write the embeddings to another file")
    if out.exists() and not overwrite:
        raise UserError(f"--out {out} exists; give --overwrite (-y) to replace it, or another --out")


def encoder_device(setting: str) -> str:
    """--device, refused before the encoder loads: torch refused a bad name or an absent GPU only after the
    load (umT5-XXL reads 11 GB first), in a traceback (exit 1)."""
    from loom_live.engine.config import DEVICE_SETTINGS, is_device_setting
    from loom_live.engine.models.loading import resolve_device
    from loom_live.host_bridge.wire.errors import UserError

    if not is_device_setting(setting):
        raise UserError(f"--device {setting!r} is not allowed; expected {DEVICE_SETTINGS}")
    return str(resolve_device(setting, key="--device"))  # a GPU this machine lacks: ValueError, said as exit 2


def run(args: argparse.Namespace) -> int:
    from loom_live.engine.stream.prompts import HashTextEncoder, UMT5TextEncoder
    from loom_live.host_bridge.wire.errors import UserError
    from loom_live.plugin.player.options import PlayerError, read_prompt_file

    out = args.out.expanduser()
    check_out(out, args.from_file.expanduser() if args.from_file else None, args.overwrite)
    device = encoder_device(args.device)
    prompts = list(args.prompts)
    if args.from_file:
        try:
            prompts += read_prompt_file(args.from_file, "--from-file")
        except PlayerError as exc:
            raise UserError(str(exc)) from None
    if not prompts:
        raise UserError("no prompts given (pass them as arguments or with --from-file)")
    if args.encoder == "hash":
        encoder: TextEncoder = HashTextEncoder(args.dim)
    else:
        if not args.encoder_path:
            raise UserError("--encoder umt5 needs --encoder-path (a local umT5 directory)")
        encoder = UMT5TextEncoder(args.encoder_path, device=device)
    write_embeddings(encoder, prompts, out)
    print(f"wrote {out}")
    return 0
