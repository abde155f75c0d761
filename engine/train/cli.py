"""Command line of the embedded model's recipe.

    python -m loom_live.engine.train prepare [--out build/loom_styles_256.npz] [--held-out]  # CPU: styled pairs
    python -m loom_live.engine.train table [--out engine/models/weights/style_text.npz]  # CPU: text table
    python -m loom_live.engine.train fit [--data ...] [--out build/embedded] [--vae-seconds S] [--dit-seconds S]
    python -m loom_live.engine.train eval [--weights ...] [--out docs/embedded/eval.json]   # CPU: model card metrics
    python -m loom_live.engine.train picture [--out docs/embedded-styles.png]

Run from a source checkout, every default path is the checkout's, from any folder (`table`, `eval` and
`picture` replace the files the repository keeps, and prepare, fit and eval find each other's files); an
installed Loom takes them from the current folder, not from its package folder in site-packages.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from loom_live.host_bridge.wire.checkout import loom_checkout


def _size(text: str) -> int:
    try:
        side = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of pixels, got {text!r}") from None
    if side < 16 or side % 16:
        raise argparse.ArgumentTypeError(f"{side}: expected a multiple of 16, at least 16 (the model's blocks)")
    return side


def _frames(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of frames, got {text!r}") from None
    if n < 6:
        raise argparse.ArgumentTypeError(f"{n}: expected 6 or more (the first chunk of 5 frames and the next, "
                                         "so the chunk boundaries are measured)")
    return n


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except an empty one ("" or None): its help says what none means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default in ("", None) else super()._get_help_string(action)


def defaults_root() -> tuple[Path, str]:
    """The folder `loom train`'s files default to, and how --help names it: the source checkout Loom runs from,
    so that prepare, fit and eval agree on their files from any folder; an installed Loom's own folder is in
    site-packages, no place to write, so there the current folder."""
    checkout = loom_checkout()
    if checkout is not None:
        return checkout, "the source checkout"
    return Path.cwd(), "the current folder (Loom is installed, not run from a source checkout)"


def prepare_out(out: str | None, held_out: bool) -> str:
    """prepare's data file: the one given, else the one fit reads under `defaults_root` (`--data`, or with
    `held_out` `--eval-data`: held-out clips written over the training file would be trained on)."""
    from loom_live.engine.train.recipe import RecipeConfig

    if out is not None:
        return out
    return str(defaults_root()[0] / (RecipeConfig.eval_data if held_out else RecipeConfig.data))


def build_parser() -> argparse.ArgumentParser:
    """Every option has a help text with its default: fit's come from `RecipeConfig`'s field docs. Every file
    defaults to its place under `defaults_root`; a relative path given on the command line is still taken
    from the current folder."""
    from loom_live.engine.train.recipe import WORKING_FILES, RecipeConfig
    from loom_live.host_bridge.wire.errors import OneLineParser

    root, where = defaults_root()
    epilog = f"Files default to {where}, {root}; a relative path given is from the current folder."
    p = OneLineParser(prog="loom train", description="train Loom's embedded default model", epilog=epilog)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, about: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=about, description=about, epilog=epilog, formatter_class=_WithDefaults)

    prep = command("prepare", "style the training clips (CPU) into one data file")
    prep.add_argument("--out", default=None,
                      help=f"the data file `fit --data` reads (default {root / RecipeConfig.data}; with --held-out "
                           f"the one `fit --eval-data` reads, {root / RecipeConfig.eval_data})")
    prep.add_argument("--size", type=_size, default=256, help="frame side in pixels, a multiple of 16")
    prep.add_argument("--held-out", action="store_true", help="the held-out clips instead (evaluation only)")
    table = command("table", "distil the style text table from the sentence model")
    table.add_argument("--out", default=str(root / RecipeConfig.table),
                       help="the style text table (from a checkout: the one the package ships)")
    fit = command("fit", "train the VAE and the DiT (one GPU, about 10 minutes)")
    for f in dataclasses.fields(RecipeConfig):
        if f.type in ("str", "float", "int"):
            kind = {"str": str, "float": float, "int": int}[f.type]
            default = str(root / f.default) if f.name in WORKING_FILES else f.default
            fit.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default, help=f.metadata["doc"])
    ev = command("eval", "measure the model card's metrics on the held-out clips (CPU)")
    ev.add_argument("--weights", default=None, help="a weights file to measure (default: the shipped weights)")
    ev.add_argument("--out", default=str(root / "docs/embedded/eval.json"),
                    help="the JSON report the model card quotes, beside the train log")
    ev.add_argument("--frames", type=_frames, default=49, help="frames of each held-out clip, 6 or more")
    pic = command("picture", "the README picture: input frames beside four styles")
    pic.add_argument("--out", default=str(root / "docs/embedded-styles.png"), help="the picture the README shows")
    return p


def main(argv: list[str] | None = None) -> int:
    from loom_live.host_bridge.wire.errors import UserError

    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (BrokenPipeError, FileNotFoundError):
        raise  # the `loom` command's own handling (exit 141; a one-line error)
    except OSError as exc:  # a folder that cannot be written, a full disk: one line, not a traceback
        raise UserError(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}") from None


def _run(args: argparse.Namespace) -> int:
    if args.command == "prepare":
        from loom_live.engine.train.data import prepare

        print(prepare(prepare_out(args.out, args.held_out), size=args.size, held_out=args.held_out))
    elif args.command == "table":
        from loom_live.engine.train.text_table import build

        print(build(args.out))
    elif args.command == "fit":
        from loom_live.engine.train.recipe import RecipeConfig, run

        names = {f.name for f in dataclasses.fields(RecipeConfig)}
        cfg = RecipeConfig(**{k: v for k, v in vars(args).items() if k in names})
        print(run(cfg))
    elif args.command == "eval":
        from loom_live.engine.train.evaluate import main as evaluate

        evaluate(args.weights, args.out, args.frames)
    elif args.command == "picture":
        from loom_live.engine.train.evaluate import picture

        print(picture(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
