"""Run the listed configurations of every method on a tiny model through the `adept-ext` command and
keep their reports, or diff two such recordings: a refactoring of options or runners must leave
every report as it was, timing, version and path fields aside.

    python tools/compare_reports.py record DIR      # run every configuration, write DIR/<name>.json
    python tools/compare_reports.py diff DIR_A DIR_B  # exit 1 and print the differences, if any

Each recording holds the run's `run.json` configuration and its `report.json`, parsed (key order is
not compared), with the fields that differ from one run to the next removed (`VOLATILE`) and the
run directory's path replaced by `<run>`. The tiny model is `tests/tiny_models.py`'s (a 4-layer
Llama with the SmolLM2 tokenizer, random weights) on real text; 2 optimizer steps per task.
"""
import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VOLATILE = {"seconds", "time", "wall_s", "tokens_per_s", "tokens_per_second", "peak_memory_mb", "machine",
            "version", "torch", "transformers", "python", "commit", "date", "wall_seconds"}

COMMON = ["--max-length", "32", "--batch-size", "2", "--steps", "2", "--warmup-steps", "1", "--probe-blocks", "2",
          "--eval-blocks", "2", "--save-every", "0"]
RUN = [*COMMON, "--eval-every", "1"]
LAYERS, RATES, LORA = ["--k", "1"], ["--recompute-every", "1"], ["--lora-rank", "2"]
CONFIGURATIONS = {  # name -> (command, flags beyond the common ones: only options the method takes)
    "run-adept": ("run", ["--method", "adept", *LAYERS, *RATES]),
    "run-adept-per-kind": ("run", ["--method", "adept", *LAYERS, *RATES, "--normalize", "per_kind",
                                   "--placement", "uniform"]),
    "run-full": ("run", ["--method", "full"]),
    "run-llama-pro": ("run", ["--method", "llama_pro", "--layers", "1,2"]),
    "run-freeze-deep": ("run", ["--method", "freeze_deep", "--boundary", "2"]),
    "run-lora": ("run", ["--method", "lora", "--lora-rank", "4"]),
    "run-adept-no-expand": ("run", ["--method", "adept_no_expand", *LAYERS, *RATES]),
    "run-adept-uniform-lr": ("run", ["--method", "adept_uniform_lr", *LAYERS]),
    "run-lora-mix": ("run", ["--method", "lora", *LORA, "--mix-general", "0.25"]),
    "run-full-merge-back": ("run", ["--method", "full", "--merge-back", "auto", "--merge-back-schedule", "lines",
                                    "--merge-back-min", "0.2", "--max-forgetting", "0.05"]),
    "continual-seq-full": ("continual", ["--method", "seq_full"]),
    "continual-seq-lora": ("continual", ["--method", "seq_lora", *LORA]),
    "continual-replay": ("continual", ["--method", "replay", "--replay-fraction", "0.5"]),
    "continual-replay-lora": ("continual", ["--method", "replay", *LORA, "--replay-base", "lora",
                                            "--replay-fraction", "0.5"]),
    "continual-o-lora": ("continual", ["--method", "o_lora", *LORA, "--o-lora-lambda", "1.0"]),
    "continual-o-lora-l1": ("continual", ["--method", "o_lora", *LORA, "--o-lora-penalty", "l1"]),
    "continual-adept-seq": ("continual", ["--method", "adept_seq", *LAYERS, *RATES]),
    "continual-llama-pro-seq": ("continual", ["--method", "llama_pro_seq", *LAYERS]),
    "continual-eoupct": ("continual", ["--method", "eoupct", "--eoupct-rank", "2", "--eoupct-proxy-len", "4"]),
    "continual-eoupct-embeds": ("continual", ["--method", "eoupct", "--eoupct-proxy", "embeds",
                                              "--eoupct-proxy-len", "4", "--eoupct-no-virtual"]),
    "continual-deal": ("continual", ["--method", "deal", "--deal-rank", "2", "--deal-new-rank", "2"]),
    "continual-deal-public": ("continual", ["--method", "deal", "--deal-rank", "2", "--deal-variant", "public_code"]),
    "continual-per-task": ("continual", ["--method", "per_task", *LORA]),
    "continual-seq-lora-train-on-prompt": ("continual", ["--method", "seq_lora", *LORA, "--train-on-prompt"]),
    "continual-seq-lora-freeze-bottom": ("continual", ["--method", "seq_lora", *LORA, "--freeze-bottom", "1"]),
    "continual-seq-lora-merge-back": ("continual", ["--method", "seq_lora", *LORA, "--merge-back", "0.5"]),
    "continual-ewc": ("continual", ["--method", "ewc", *LORA]),
    "continual-lwf": ("continual", ["--method", "lwf", *LORA]),
    "continual-agem": ("continual", ["--method", "agem", *LORA]),
    "continual-merge-tasks": ("continual", ["--method", "merge_tasks", *LORA]),
    "continual-osf": ("continual", ["--method", "osf"]),
}


def normalized(value, run_dir: str):
    """`value` without the VOLATILE keys, with `run_dir` in strings replaced by `<run>`."""
    if isinstance(value, dict):
        return {k: normalized(v, run_dir) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normalized(v, run_dir) for v in value]
    if isinstance(value, str):
        return value.replace(run_dir, "<run>")
    return value


def record(dest: Path, names):
    from adept_ext.cli import main
    from tiny_models import write_sequence_workspace

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ws = write_sequence_workspace(Path(tmp))
        for name in names:
            command, flags = CONFIGURATIONS[name]
            out = ws / "runs" / name
            data = (["--general", str(ws / "general"), "--domain", str(ws / "domain.jsonl")] if command == "run" else
                    ["--general", str(ws / "general"), "--tasks", f"{ws / 'docs.txt'},{ws / 'topics.jsonl'}"])
            argv = [command, "--model", str(ws / "tiny"), "--out", str(out), "--no-progress",
                    *(RUN if command == "run" else COMMON), *data, *flags]
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(argv)
            if code != 0:
                raise SystemExit(f"{name}: adept-ext exited {code}: {' '.join(argv)}")
            result = {"run.json": json.loads((out / "run.json").read_text())["config"],
                      "report.json": json.loads((out / "report.json").read_text())}
            (dest / f"{name}.json").write_text(json.dumps(normalized(result, str(ws)), indent=1, sort_keys=True))
            print(f"{name}: recorded", flush=True)


def differences(a, b, where=""):
    """Paths at which `a` and `b` differ (keys on one side only included)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in
                (differences(a[k], b[k], f"{where}.{k}") if k in a and k in b else
                 [f"{where}.{k}: only in {'the first' if k in a else 'the second'}"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def diff(first: Path, second: Path) -> int:
    names = sorted({p.name for p in first.glob("*.json")} | {p.name for p in second.glob("*.json")})
    found = 0
    for name in names:
        if not ((first / name).exists() and (second / name).exists()):
            print(f"{name}: in one recording only")
            found += 1
            continue
        lines = differences(json.loads((first / name).read_text()), json.loads((second / name).read_text()))
        for line in lines:
            print(f"{name}{line}")
        found += len(lines)
    print(f"{len(names)} reports compared, {found} differences")
    return 1 if found else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("dest", type=Path)
    rec.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    dif = sub.add_parser("diff")
    dif.add_argument("first", type=Path)
    dif.add_argument("second", type=Path)
    args = parser.parse_args()
    if args.action == "record":
        names = args.only.split(",") if args.only else list(CONFIGURATIONS)
        unknown = [n for n in names if n not in CONFIGURATIONS]
        if unknown:
            parser.error(f"unknown configuration(s): {', '.join(unknown)}")
        record(args.dest, names)
        return 0
    return diff(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
