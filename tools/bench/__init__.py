"""The benchmarks of tools/bench.py: `common` is the shared harness (timing, peak memory, the
models the benchmarks build, result rows and the CSV), each other module one benchmark with
`run(args, device) -> results` (the JSON of that benchmark) and `rows(results) -> rows` (the
same figures as rows of docs/results/bench.csv); `tables` renders docs/benchmarks.md's tables
from that CSV."""

# The benchmarks, in the order `all` runs them (each the name of its module here).
NAMES = ("importance", "probe", "lr", "projection", "lens", "linear_ce", "placement", "probe_scaling",
         "eoupct_step", "corpus", "train_step", "packing", "replay_step")
