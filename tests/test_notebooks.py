"""The notebooks run top to bottom (they assert their own results)."""
import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NB = pathlib.Path(__file__).parent.parent / "notebooks"


@pytest.mark.parametrize("name", sorted(p.name for p in NB.glob("*.ipynb")))
def test_notebook_executes(name):
  nb = nbformat.read(NB / name, as_version=4)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the kernel inherits it
  client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NB)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
