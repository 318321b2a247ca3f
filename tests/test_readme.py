"""The README's library example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_library_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "import rollkeep as rk" in b)
    exec(compile(example, "README.md", "exec"), {})
