"""Every notebook runs top to bottom: its code cells are executed as one script (on the simulator in
CI, on the GPU otherwise), from the notebooks/ folder."""
import glob
import json
import os
import subprocess
import sys

import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    nb = json.load(open(path))
    code = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    script = tmp_path / "notebook.py"
    script.write_text(code)
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(script)], cwd=os.path.dirname(path), env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_there_are_notebooks():
    assert NOTEBOOKS
