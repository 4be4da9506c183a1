"""kvlab.course.viz.page_table_heatmap: draws at small and large sizes, blanks unmapped cells, highlights."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.collections import PatchCollection  # noqa: E402

from kvlab.alloc.paging import UNMAPPED, new_page_table  # noqa: E402
from kvlab.course.viz import page_table_heatmap  # noqa: E402


def filled_table(rows: int, cols: int, page_size: int, seed: int) -> torch.Tensor:
    """A table whose rows are mapped to random pages up to a random length (rest unmapped)."""
    gen = torch.Generator().manual_seed(seed)
    table = new_page_table(rows - 1, cols, page_size, device="cpu")
    pages = torch.randperm(rows * cols // page_size, generator=gen)
    for r in range(rows):
        n = int(torch.randint(0, cols + 1, (1,), generator=gen))
        slots = (pages[r * (cols // page_size):(r + 1) * (cols // page_size)].repeat_interleave(page_size) * page_size
                 + torch.arange(cols) % page_size)
        table[r, :n] = slots[:n].to(torch.int32)
    return table


def image_data(ax) -> np.ma.MaskedArray:
    return np.ma.masked_invalid(ax.images[0].get_array())


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_small_table_colours_by_page_and_blanks_unmapped():
    table = torch.tensor([[8, 9, 10, 11, 0, 1, -1, -1], [-1] * 8], dtype=torch.int32)
    ax = page_table_heatmap(table, 4)
    data = image_data(ax)
    assert data.shape == (2, 8)
    assert data[0, :6].tolist() == [2, 2, 2, 2, 0, 0]  # colour value = slot // page_size
    assert data.mask[0, 6:].all() and data.mask[1].all() and not data.mask[0, :6].any()
    assert ax.kvlab_view.block == 1
    assert len(ax.texts) == 6  # small view: slot numbers written in the mapped cells


def test_readable_at_8_by_256():
    table = filled_table(8, 256, 16, seed=0)
    ax = page_table_heatmap(table, 16)
    data = image_data(ax)
    assert data.shape == (8, 256)  # no downsampling at this width
    np.testing.assert_array_equal(data.mask, (table == UNMAPPED).numpy())
    assert len(ax.lines) >= 256 // 16 - 1  # page boundaries drawn


def test_downsampled_at_64_by_4096():
    table = filled_table(64, 4096, 16, seed=1)
    ax = page_table_heatmap(table, 16, max_cells=512)
    view = ax.kvlab_view
    assert view.block % 16 == 0 and view.values.shape[1] * view.block >= 4096
    assert view.values.shape[1] <= 512
    assert "downsampled" in ax.get_title()
    # each cell shows the page of its block's first mapped entry; blank iff the block is unmapped
    t = table.numpy()
    b = view.block
    for r in [0, 17, 63]:
        for c in range(view.values.shape[1]):
            block = t[r, c * b:(c + 1) * b]
            mapped = block[block != UNMAPPED]
            if mapped.size:
                assert view.values[r, c] == mapped[0] // 16
            else:
                assert np.isnan(view.values[r, c])


def test_empty_mask_and_highlight():
    table = torch.arange(16, dtype=torch.int32).view(2, 8)
    empty = torch.zeros(2, 8, dtype=torch.bool)
    empty[1, 4:] = True
    highlight = torch.zeros(2, 8, dtype=torch.bool)
    highlight[0, 3] = highlight[1, 1] = True
    ax = page_table_heatmap(table, 2, empty=empty, highlight=highlight)
    assert image_data(ax).mask[1, 4:].all() and not image_data(ax).mask[0].any()
    marks = [c for c in ax.collections if isinstance(c, PatchCollection)]
    assert len(marks) == 1 and len(marks[0].get_paths()) == 2


def test_categories_draw_a_legend():
    table = torch.arange(12, dtype=torch.int32).view(1, 12)
    parts = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1, -1]])
    ax = page_table_heatmap(table, 4, categories=parts, category_labels=["part 1", "part 2", "part 3"])
    data = image_data(ax)
    assert data[0, :9].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2] and data.mask[0, 9:].all()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["part 1", "part 2", "part 3"]


def test_rows_and_cols_select_a_window():
    table = filled_table(8, 64, 4, seed=2)
    ax = page_table_heatmap(table, 4, rows=[1, 5], cols=slice(8, 24))
    data = image_data(ax)
    assert data.shape == (2, 16)
    np.testing.assert_array_equal(data.mask, (table[[1, 5], 8:24] == UNMAPPED).numpy())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="page_table"):
        page_table_heatmap(torch.zeros(4), 4)
    with pytest.raises(ValueError, match="highlight"):
        page_table_heatmap(torch.zeros(2, 4), 4, highlight=torch.zeros(3, 4, dtype=torch.bool))
