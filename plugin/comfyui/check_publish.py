"""Refuse to publish the node package while its registry metadata still holds placeholders.

`comfy node publish` sends pyproject.toml as it is, and the registry shows its URLs and icon on the
package's page for that version. The public repository is not known to a Loom checkout, so the file
ships with placeholders that the publisher fills in; the publish steps (README, "ComfyUI") run this
check first, and it fails, naming each field, while any placeholder is left.

    python plugin/comfyui/check_publish.py [path/to/pyproject.toml]

Exit code 0 when the metadata can be published, 1 (one line per field to fill in) when not.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PLACEHOLDER = "OWNER"  # what the shipped URLs hold where the repository's owner goes
# [project.urls] fields, and what each must point at
URL_FIELDS = {"Repository": "the public repository", "Documentation": "the README's ComfyUI section there",
              "Bug Tracker": "its issue tracker"}


def problems(meta: dict[str, Any]) -> list[str]:
    """What the publisher must still fill in, one line per field (empty: ready to publish)."""
    found = []
    urls = meta.get("project", {}).get("urls", {})
    for name, what in URL_FIELDS.items():
        found += _url_problem(f"[project.urls] {name}", urls.get(name, ""), what)
    comfy = meta.get("tool", {}).get("comfy", {})
    if not str(comfy.get("PublisherId", "")).strip():
        found.append("[tool.comfy] PublisherId: empty; set it to your publisher id on registry.comfy.org")
    found += _url_problem("[tool.comfy] Icon", comfy.get("Icon", ""), "the package's square icon image")
    return found


def _url_problem(field: str, value: Any, what: str) -> list[str]:
    text = str(value or "").strip()
    if not text:
        return [f"{field}: empty; set it to the https:// URL of {what}"]
    if PLACEHOLDER in text:
        return [f"{field}: {text!r} is a placeholder; replace {PLACEHOLDER} so that it is the https:// URL of {what}"]
    if not text.startswith("https://"):
        return [f"{field}: {text!r} is not allowed; expected an https:// URL of {what}"]
    return []


def main(argv: list[str] | None = None) -> int:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        print("check_publish: needs Python 3.11 or later (tomllib)", file=sys.stderr)
        return 1
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else Path(__file__).with_name("pyproject.toml")
    found = problems(tomllib.loads(path.read_text(encoding="utf-8")))
    for line in found:
        print(f"{path}: {line}", file=sys.stderr)
    if found:
        print("check_publish: not ready to publish; fill in the fields above (README, 'ComfyUI')", file=sys.stderr)
        return 1
    print(f"check_publish: {path} is ready to publish")
    return 0


if __name__ == "__main__":
    sys.exit(main())
