"""Runs the README's example for the Messages and Responses APIs, as
written, against a gateway on the embedded default.

Usage: python readme_faces.py GATEWAY_ROOT_URL

The README's Python block that uses the `anthropic` package is run on its
own, with its address replaced by GATEWAY_ROOT_URL (it defines every name
it uses; `.ci/readme-blocks` runs it untouched); it must print the mock's
two answers. Exits non-zero otherwise.
"""

import contextlib
import io
import pathlib
import re
import sys



def main() -> None:
    root = sys.argv[1]
    readme = pathlib.Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    block = next(b for b in blocks if "anthropic.Anthropic" in b)
    block = block.replace("http://127.0.0.1:8080", root)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(block, {"__name__": "__main__"})  # noqa: S102 - the README's own example
    lines = out.getvalue().splitlines()
    if len(lines) != 2 or not lines[0].endswith("to: Where is my order?") \
            or not lines[1].endswith("to: What is my name?"):
        sys.exit(f"FAIL the README's Messages and Responses example printed: {lines}")
    print("README: the Messages and Responses example works as written")


if __name__ == "__main__":
    main()
