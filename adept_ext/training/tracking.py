"""Live tracking of a run (`--report-to`, Hugging Face's names): the same scalars go to every
chosen backend — TensorBoard (event files in `<out>/runs`), MLflow (a local file store in
`<out>/mlruns` unless MLFLOW_TRACKING_URI says otherwise), Weights & Biases and trackio — from
rank 0 only. A backend that is not installed is an error before anything trains."""
import importlib.util
import os
from pathlib import Path
from typing import Dict, List

from .. import parallel
from ..errors import RunError

BACKENDS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}


def backends_of(report_to: str) -> List[str]:
    """The backends named by `report_to` ("none", or comma-separated names); RunError for an
    unknown name, for "none" beside another, or for one whose package is not installed."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in BACKENDS]
    if not names or unknown or "none" in names:
        raise RunError(f"report_to must be none or a comma-separated list of {', '.join(BACKENDS)}, got {report_to!r}")
    missing = [n for n in names if importlib.util.find_spec(BACKENDS[n]) is None]
    if missing:
        raise RunError(f"--report-to {','.join(missing)}: the package is not installed "
                       f"(pip install {' '.join(BACKENDS[n] for n in missing)})")
    return names


class Tracker:
    """Scalars by name and step to every chosen backend (nothing on ranks other than 0, nothing
    for "none"). `config`: the run's options, recorded once where the backend keeps them."""

    def __init__(self, report_to: str, out: Path, config: Dict, name: str):
        self.writers = []
        if not parallel.is_main():
            return
        for backend in backends_of(report_to):
            self.writers.append(getattr(self, f"_{backend}")(Path(out), config, name))

    @property
    def active(self) -> bool:
        return bool(self.writers)

    def log(self, metrics: Dict[str, float], step: int):
        for log, _ in self.writers:
            log({k: float(v) for k, v in metrics.items()}, step)

    def close(self):
        for _, close in self.writers:
            close()
        self.writers = []

    @staticmethod
    def _tensorboard(out, config, name):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(out / "runs"))
        writer.add_text("config", "\n".join(f"{k} = {v!r}" for k, v in config.items()))

        def log(metrics, step):
            for key, value in metrics.items():
                writer.add_scalar(key, value, step)
        return log, writer.close

    @staticmethod
    def _mlflow(out, config, name):
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        mlflow.set_experiment("adept-ext")
        run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: v for k, v in config.items()})

        def close():
            if mlflow.active_run() is not None and mlflow.active_run().info.run_id == run.info.run_id:
                mlflow.end_run()
        return (lambda metrics, step: mlflow.log_metrics(metrics, step=step)), close

    @staticmethod
    def _wandb(out, config, name):
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "adept-ext"), name=name, config=config, dir=str(out))
        return (lambda metrics, step: run.log(metrics, step=step)), run.finish

    @staticmethod
    def _trackio(out, config, name):
        import trackio

        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "adept-ext"), name=name, config=config)
        return (lambda metrics, step: trackio.log(metrics, step=step)), trackio.finish
