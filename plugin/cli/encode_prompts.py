"""`loom encode-prompts`: precompute prompt embeddings on a machine that has the text encoder.

The result is a safetensors file that `prompt.encoder: file` reads, so a show machine needs
neither transformers nor the 11 GB umT5 weights, only the prompts it will use. The encoders (and
torch) are imported only when this subcommand runs: `loom` builds every subcommand's parser on
each call, and `loom play` or `loom serve --passthrough` must not pay for torch in the player.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom_live.engine.stream.prompts import TextEncoder


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("encode-prompts", help="precompute prompt embeddings into a file (prompt.encoder: file)")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--from-file", type=Path, help="a text file with one prompt per line")
    p.add_argument("--encoder", choices=("umt5", "hash"), default="umt5",
                   help="umt5: the real text encoder (needs --encoder-path); hash: the small deterministic one")
    p.add_argument("--encoder-path", help="local umT5 directory (tokenizer and encoder weights)")
    p.add_argument("--dim", type=int, default=4096, help="embedding width for --encoder hash")
    p.add_argument("--device", default="cpu", help="where the encoder runs: cpu or cuda (default cpu)")
    p.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    p.set_defaults(func=run)


def write_embeddings(encoder: TextEncoder, prompts: list[str], out: Path) -> None:
    from safetensors.torch import save_file

    from loom_live.engine.stream.prompts import FILE_KEY_PREFIX, check_prompt, prompt_key

    texts = list(dict.fromkeys(check_prompt(p) for p in prompts))
    tensors, names = {}, {}
    for i, text in enumerate(texts, 1):
        key = prompt_key(text)
        tensors[FILE_KEY_PREFIX + key] = encoder.encode([text])[0].contiguous()
        names[key] = text
        print(f"[{i}/{len(texts)}] {text}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"prompts": json.dumps(names)})


def run(args: argparse.Namespace) -> int:
    from loom_live.engine.stream.prompts import HashTextEncoder, UMT5TextEncoder
    from loom_live.host_bridge.wire.errors import UserError

    prompts = list(args.prompts)
    if args.from_file:
        prompts += [line for line in args.from_file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise UserError("no prompts given (pass them as arguments or with --from-file)")
    if args.encoder == "hash":
        encoder: TextEncoder = HashTextEncoder(args.dim)
    else:
        if not args.encoder_path:
            raise UserError("--encoder umt5 needs --encoder-path (a local umT5 directory)")
        encoder = UMT5TextEncoder(args.encoder_path, device=args.device)
    write_embeddings(encoder, prompts, args.out)
    print(f"wrote {args.out}")
    return 0
