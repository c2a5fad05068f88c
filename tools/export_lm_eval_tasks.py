#!/usr/bin/env python
"""Write adept_ext's instruction tasks (and the offline general suite) as lm-eval tasks: per task the held-out
examples that `adept-ext continual --seed SEED` scores, as a JSONL file, and its YAML tasks
(adept_TASK_mc: multiple choice over the label set; adept_TASK_gen: greedy exact match as adept_ext
defines it; with a _seedN suffix for a seed N other than 0). What they are: docs/evaluation.md,
"adept_ext's tasks in lm-eval". adept-ext's --benchmarks writes them itself; this is for lm-eval's command.

    python tools/export_lm_eval_tasks.py --out DIR [--tasks classification,adept_arc_easy] [--seed 0]

then `adept-ext eval --benchmarks adept_bbc_topic_mc,adept_bbc_topic_gen --include-path DIR`, or lm-eval's
own command: `lm_eval --model hf --model_args pretrained=MODEL --include_path DIR --tasks adept_sms_spam_gen`.
"""
import argparse
import sys

from adept_ext.errors import InputError
from adept_ext.evaluation.lm_eval_tasks import GENERAL, SUITE, export_tasks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder to write (created; an include path of lm-eval)")
    parser.add_argument("--tasks", default=f"classification,{GENERAL}",
                        help="comma-separated: bbc-topic, sms-spam, rt-sentiment, parl-language, classification "
                             f"(the four), the general suite's tasks and groups: {', '.join(SUITE)}")
    parser.add_argument("--seed", type=int, default=0, help="the runner's --seed, which splits off the held-out items")
    args = parser.parse_args(argv)
    try:
        written = export_tasks([t.strip() for t in args.tasks.split(",") if t.strip()], args.out, args.seed)
    except (InputError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.out}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
