"""The README's Python example runs and says what the README claims."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_example_runs():
    text = README.read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    # one line per group, then the capacity; the MLA group holds 24 target + 5 draft layers
    assert any(line.split()[:3] == ["1", "full", "29"] and line.endswith("33408") for line in lines)
    assert "29 x 1152 = 33408" in text
    assert float(lines[-1].split()[0]) > 1
