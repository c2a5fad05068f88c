"""Run directories: what a command may write into, delete, or resume from.

Every command writes `run.json` first (the tool, the command and its full configuration): it marks
the directory as written by adept-ext — `--overwrite` deletes only such a directory, never a
folder of the user's — and it is where `--resume` takes the run's own options from. Files are
written atomically (a temporary sibling renamed into place), so a kill leaves either the old or
the new file, never half of one.
"""
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional

from ..errors import RunError

MARKER = "run.json"
CHECKPOINT = "checkpoint.pt"
FINISHED = "report.json"
TOOL = "adept-ext"


def _umask_mode(mode: int) -> int:
    """`mode` as the process umask would leave it (temporary files are created private)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def atomic_write(path: Path, write):
    """Write through a temporary file in the same folder and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _umask_mode(0o666))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_dir(path: Path, write):
    """Write a directory through a temporary sibling and rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        os.chmod(tmp, _umask_mode(0o777))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_json(path: Path) -> Optional[Dict]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def marker(out: Path) -> Optional[Dict]:
    """The run.json of `out` when adept-ext wrote it (or, for a run finished before run.json
    existed, its report.json's configuration), else None."""
    record = _read_json(out / MARKER)
    if record is not None and record.get("tool") == TOOL:
        return record
    report = _read_json(out / FINISHED)
    if report is not None and isinstance(report.get("config"), dict) and "method" in report:
        return {"tool": TOOL, "command": "run", "config": report["config"]}
    return None


def check_out(cfg, command: str) -> Path:
    """Refuse, before anything is loaded or written, an output directory that holds another run
    (unless --resume or --overwrite apply to it), naming what will work for that directory."""
    out = Path(cfg.out)
    holds_files = out.is_dir() and any(out.iterdir())
    ours = marker(out) if holds_files else None
    finished = (out / FINISHED).exists()
    resumable = (out / CHECKPOINT).exists()
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} is a file, not a directory")
    if cfg.resume:
        if resumable:
            return out
        if finished:
            raise RunError(f"--resume: the run in {out} is finished (report.json); nothing to resume")
        if ours:
            raise RunError(f"--resume: the run in {out} stopped before its first checkpoint; "
                           "start it again with --overwrite")
        raise RunError(f"--resume: {out} holds no adept-ext run to resume")
    if holds_files and not ours:
        raise RunError(f"{out} holds files that adept-ext did not write: choose another --out "
                       "(--overwrite only replaces a directory adept-ext wrote)")
    if holds_files and not cfg.overwrite:
        if resumable and command == ours.get("command"):
            raise RunError(f"{out} holds a stopped run of `adept-ext {command}`: continue it with --resume, "
                           "or replace it with --overwrite")
        state = "a finished" if finished else "an unfinished"
        raise RunError(f"{out} holds {state} run of `adept-ext {ours.get('command')}`: choose another --out, "
                       "or replace it with --overwrite")
    return out


def prepare_out(cfg, command: str) -> Path:
    """The checked output directory, emptied for --overwrite, with its run.json written; call once
    the inputs have been checked."""
    out = check_out(cfg, command)
    if cfg.overwrite and not cfg.resume and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.resume:
        record = {"tool": TOOL, "command": command, "config": asdict(cfg)}
        atomic_write(out / MARKER, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=2)))
    return out


def saved_options(out: Path, command: str) -> Dict:
    """The options the run in `out` was started with (for --resume); RunError if there is none."""
    record = marker(out)
    if record is None:
        raise RunError(f"--resume: {out} holds no adept-ext run ({MARKER} is missing)")
    if record.get("command") not in (command, *(("run", "train") if command in ("run", "train") else ())):
        raise RunError(f"--resume: {out} holds a {record.get('command')} run, not a {command} run")
    return dict(record["config"])
