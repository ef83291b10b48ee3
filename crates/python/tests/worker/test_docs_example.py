"""The API example in docs/python.md runs as printed and says what the page says it says."""

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[4] / "docs" / "python.md"


def test_the_api_example_in_docs_python_md_runs(tmp_path):
    text = DOC.read_text()
    match = re.search(r"<!-- example: api -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/python.md has no example marked <!-- example: api -->"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "released req-1 completed",
        "late read refused: expected 1 found 0",
    ]
    assert "It prints `released req-1 completed` and `late read refused: expected 1 found 0`" in text
