"""The README's Python examples run as written (on the simulator in CI, on the GPU otherwise)."""
import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)
    assert blocks, "the README has no Python example"
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks) + "\nprint('README examples ran')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "README examples ran" in proc.stdout
