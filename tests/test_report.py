import pytest

from adept_ext import report


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions would write, instead of PNG files."""
    saved = []
    monkeypatch.setattr(report, "_save", lambda fig, path: saved.append(fig))
    return saved


def test_moving_average():
    assert report.moving_average([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]
    assert report.moving_average([4.0], 3) == [4.0]
    with pytest.raises(ValueError, match="window"):
        report.moving_average([1.0], 0)


def test_loss_curves_show_the_trend_over_the_raw_loss(figures, tmp_path):
    losses = [3.0 - 0.01 * i + (0.5 if i % 2 else -0.5) for i in range(60)]  # noisy, slowly falling
    history = {"train": [{"step": i + 1, "loss": v} for i, v in enumerate(losses)],
               "eval": [{"step": 60, "general_loss": 3.1, "domain_loss": 2.5}]}
    report.plot_loss_curves(history, {"general_loss": 3.0, "domain_loss": 3.0}, tmp_path / "loss.png")
    train_ax = figures[0].axes[0]
    raw, smooth = train_ax.get_lines()
    assert list(raw.get_ydata()) == losses
    assert smooth.get_label().startswith("moving average")
    assert list(smooth.get_xdata()) == list(range(10, 61))  # from the first full window of 10 steps
    assert max(abs(a - b) for a, b in zip(smooth.get_ydata(), smooth.get_ydata()[1:])) < 0.2  # smooth
    assert [t.get_text() for t in train_ax.get_legend().get_texts()] == [raw.get_label(), smooth.get_label()]


def test_plots_are_written(tmp_path):
    report.plot_layer_scores([0.1, 0.3, 0.2], tmp_path / "s.png", "Δ loss", "t", highlight=[0])
    history = {"train": [{"step": 1, "loss": 3.0}], "eval": []}
    report.plot_loss_curves(history, {"general_loss": 3.0, "domain_loss": 3.0}, tmp_path / "l.png")
    for name in ("s.png", "l.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
