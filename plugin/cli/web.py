"""`loom web`: the browser-only host. The driving page's camera goes in over WebRTC, the restyled
stream comes back to it, with the controls beside it (plugin/web); it is the player with the page's
camera as its input, so everything `loom play` takes about the engine (`-c`, `--endpoint`, `-p`,
`--lora`, `--osc-port`, `-o` to record too) works the same.
"""

from __future__ import annotations

import argparse

from loom_live.plugin.cli.common import add_config_options, add_overwrite_option
from loom_live.plugin.cli.play import _size, add_run_options, add_web_options, run_options

EPILOG = """\
examples:
  loom web                                   # http://127.0.0.1:8080/ on this machine, the embedded model
  loom web 0.0.0.0:8443 --web-cert c.pem --web-key k.pem -c wan2.1-1.3b   # HTTPS for other machines, with a token
  ssh -L 8080:127.0.0.1:8080 gpu-box loom web  # a backstage GPU box, reached through an SSH tunnel
the first page opened drives (camera and controls); pages opened while it is open watch, read-only
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("web", help="restyle the browser's camera live, with the controls in the page (WebRTC)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("listen", nargs="?", default="127.0.0.1:8080", metavar="[HOST:]PORT",
                   help="where the page listens (default 127.0.0.1:8080; another host needs HTTPS or --web-proxy, "
                        "and gets a token)")
    add_config_options(p)
    add_overwrite_option(p)
    p.add_argument("-o", "--output", action="append", dest="outputs", default=[], metavar="OUTPUT",
                   help="also write the restyled stream here (as loom play -o); repeatable")
    p.add_argument("--size", type=_size, default=(256, 256), metavar="WxH",
                   help="the camera picture's size sent to the engine (default 256x256)")
    p.add_argument("--fps", type=float, default=30.0, help="the camera frame rate asked of the browser (default 30)")
    add_run_options(p)
    add_web_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loom_live.plugin.player.options import WEB_CAMERA_INPUT

    return run_options(args, input=WEB_CAMERA_INPUT, outputs=list(args.outputs), mode="live", web=args.listen)
