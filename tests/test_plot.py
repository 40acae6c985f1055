"""The main job's picture from Megatron's own log lines (copied from a main-job run), without running Megatron.

``tests/test_megatron_dilocox.py::test_main_job_short`` checks the same against a real run's SUMMARY.
"""
import json

import pytest

from megatron_dilocox.harness import plot
from megatron_dilocox.harness.launch import ClusterLog

pytestmark = pytest.mark.unit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def iteration_line(it: int, loss: float) -> str:
    return (f" [2026-12-06 02:43:17.333760] iteration {it:>8}/     200 | consumed samples: {8 * it:>12} | "
            f"elapsed time per iteration (ms): 709.1 | learning rate: 2.000000E-03 | global batch size:     8 | "
            f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.707 | number of skipped iterations:   0 |")


def validation_line(at: str, loss: float) -> str:
    return f" validation loss at {at} | lm loss value: {loss:.6E} | lm loss PPL: 2.603791E+02 | "


def cluster_log(train: dict, valid: list) -> ClusterLog:
    log = ClusterLog()
    for it, loss in train.items():
        log.feed(iteration_line(it, loss))
    for at, loss in valid:
        log.feed(validation_line(at, loss))
    return log


@pytest.fixture
def logs():
    valid = [("iteration 50", 5.562139), ("iteration 100", 5.059217), ("iteration 100 on validation set", 5.0512)]
    return [cluster_log({1: 8.349758, 50: 5.6, 100: 5.01}, valid),
            cluster_log({1: 8.358142, 50: 5.7, 100: 4.99}, valid)]


def test_series_from_megatron_lines(logs):
    data = plot.series(logs, seq_length=128)
    c1 = data["clusters"][1]
    assert c1["tokens_per_iteration"] == 8 * 128
    assert c1["train"] == {"iteration": [1, 50, 100], "tokens": [1024, 51200, 102400], "loss": [8.358142, 5.7, 4.99]}
    assert c1["validation"] == {"iteration": [50, 100, 100], "tokens": [51200, 102400, 102400],
                                "loss": [5.562139, 5.059217, 5.0512], "final": [False, False, True]}


def test_write_draws_a_png_and_saves_what_it_drew(logs, tmp_path):
    from matplotlib.image import imread
    data = plot.series(logs, seq_length=128)
    png = plot.write(data, str(tmp_path), "title")
    assert png == str(tmp_path / "loss.png")
    assert open(png, "rb").read(8) == PNG_SIGNATURE
    height, width, _ = imread(png).shape
    assert height > 100 and width > 100
    assert json.loads((tmp_path / "loss.json").read_text()) == dict(data, title="title")
