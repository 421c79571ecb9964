"""The committed notebooks were executed top to bottom and kept their outputs.

They are not re-executed here (they generate data and train a model: minutes of CPU);
`notebooks/README.md` says how to re-run them.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXPECTED = ["dataset_tour.ipynb", "training_results.ipynb", "diagnosis_walkthrough.ipynb"]
MAX_BYTES = 1_500_000

pytestmark = pytest.mark.integration


def test_the_three_notebooks_are_there():
    assert sorted(path.name for path in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)


@pytest.fixture(params=EXPECTED)
def notebook(request) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / request.param, as_version=4)


def code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_valid_nbformat(notebook):
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"


def test_every_code_cell_ran_in_order_and_has_output(notebook):
    cells = code_cells(notebook)
    assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1))
    for cell in cells:
        assert cell.outputs, f"no output from cell: {cell.source[:80]!r}"


def test_no_errors(notebook):
    for cell in code_cells(notebook):
        for output in cell.outputs:
            assert output.output_type != "error", f"{output.ename}: {output.evalue} in {cell.source[:80]!r}"
            if output.output_type == "stream":
                assert "Traceback" not in output.text, cell.source[:80]


def test_plots_embedded_and_size_bounded(notebook):
    images = [output for cell in code_cells(notebook) for output in cell.outputs
              if "image/png" in output.get("data", {})]
    assert images, "no embedded PNG plot"
    assert len(nbformat.writes(notebook).encode()) < MAX_BYTES
