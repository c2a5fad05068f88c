#!/usr/bin/env python
"""Benchmarks of adept_ext kernels against the plain-PyTorch ways a user would write them (and,
for linear_cross_entropy, the installed peers: cut-cross-entropy, Liger), measured in one run on
the same data. Medians over repeats, after warm-up. What each measures: docs/benchmarks.md.

    python tools/bench.py importance|probe|lr|projection|lens|linear_ce|placement|probe_scaling|eoupct_step|corpus|
        train_step|packing|replay_step|all
        [--size small|large] [--quick] [--json PATH] [--csv PATH] [--device cpu|cuda] [--full-table]
        [--methods M1,M2] [--steps N]
    python tools/bench.py tables [--csv PATH] [--page PATH] [--check]

adept_ext is imported as installed (make setup), or from a source tree built in place
(python setup.py build_ext --inplace) with PYTHONPATH=<the tree's root>, as tools/gpu_check.sh runs it.

--size small (default) is what 2 CPU cores finish in minutes; --size large is what users run on
a GPU: 1B-scale tensor lists, random-weight Qwen3-0.6B- and Llama-3.2-1B-shaped models built from
configs (no downloads), N 8192 x H 2048 x V 128256 for linear_cross_entropy.

--csv PATH appends every figure as a row (benchmark, provider, size, dtype, shape, metric, value,
unit, device, commit, date, command, source, note) to PATH; docs/results/bench.csv is the results
file of the project. `tables` renders docs/benchmarks.md's tables from that CSV (--check: exit 1
when the page is not what the CSV gives, instead of writing it).
"""
import argparse
import importlib
import json
import os
import sys

from bench import NAMES


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=[*NAMES, "all", "tables"])
    parser.add_argument("--size", choices=("small", "large"), default="small",
                        help="small: the CPU sizes (default); large: realistic GPU sizes (see above)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--csv", metavar="PATH",
                        help="also append the results as rows to the CSV at PATH; for `tables`, the CSV to read "
                             "(default docs/results/bench.csv)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--full-table", action="store_true",
                        help="train_step --size large: every configuration, with and without activation "
                             "checkpointing, which needs an H200's memory (default: only those with checkpointing, "
                             "which fit an 80 GB H100)")
    parser.add_argument("--methods", metavar="M1,M2",
                        help="train_step: only these methods (full, lora, adept; default: every one)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="train_step: measured steps per configuration, after the warm-up one (default: the "
                             "size's: 1 at small, 3 at large)")
    parser.add_argument("--page", metavar="PATH", help="tables: the page to render (default docs/benchmarks.md)")
    parser.add_argument("--check", action="store_true", help="tables: only check that the page is up to date")
    parser.add_argument("--imports-only", action="store_true",
                        help="import adept_ext and the benchmark's modules, then exit without measuring (no GPU "
                             "needed: tools/gpu_check.sh's device emulation)")
    args = parser.parse_args(argv)
    if args.benchmark == "tables":
        from bench import tables

        return tables.main(args.csv or tables.CSV, args.page or tables.PAGE, check=args.check)

    import torch
    from bench import common

    import adept_ext

    device = torch.device(args.device)
    names = list(NAMES) if args.benchmark == "all" else [args.benchmark]
    if args.size == "large":
        names = [name for name in names if name != "lens"]
    if args.benchmark == "all" and (device.type != "cpu" or args.size == "large"):
        names = [name for name in names if name not in ("probe_scaling", "corpus")]  # CPU measurements
    if args.size == "large" and args.benchmark == "lens":
        sys.exit("lens has one size (SmolLM2-135M)")
    modules = {name: importlib.import_module(f"bench.{name}") for name in names}
    if args.imports_only:
        print(f"imports ok: adept_ext from {os.path.dirname(adept_ext.__file__)}, bench.{', bench.'.join(modules)}")
        return 0
    if device.type == "cuda" and not (torch.cuda.is_available() and adept_ext.cuda_available()):
        sys.exit("--device cuda: no GPU, or adept_ext was built without CUDA kernels")
    results = {"machine": common.machine_info(device, args.size)}
    for name, module in modules.items():
        results[name] = module.run(args, device)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")
    if args.csv:  # after the JSON, which a failure here then does not cost
        rows = [r for name, module in modules.items()
                for r in common.run_rows(name, module.rows(results[name]), args, device, argv)]
        common.append_csv(args.csv, rows)
        print(f"\nappended {len(rows)} rows to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
