"""Write docs/api.md from the docstrings of cuonline's public functions.

    python docs/make_api.py          # rewrite docs/api.md
    python docs/make_api.py --check  # exit 1 if docs/api.md is stale (the tests run this)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a source tree
import cuonline  # noqa: E402

API = Path(__file__).with_name("api.md")


def render() -> str:
    parts = [
        "# API reference\n",
        "Generated from the docstrings by `python docs/make_api.py`; do not edit by hand.\n",
    ]
    for name in ("attention", "attention_backward", "attention_vjp", "Gradients", "merge",
                 "softmax", "log_softmax", "logsumexp"):
        fn = getattr(cuonline, name)
        signature = f"cuonline.{name}{inspect.signature(fn)}"
        parts.append(f"## `{name}`\n\n```\n{signature}\n```\n\n```text\n"
                     f"{inspect.getdoc(fn)}\n\n```\n")
    return "\n".join(parts)


def main(argv) -> int:
    text = render()
    if "--check" in argv:
        if not API.exists() or API.read_text() != text:
            print(f"{API} is stale: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    API.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
