"""The README's Python examples run as pasted."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    for index, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {index}", "exec"), {})
