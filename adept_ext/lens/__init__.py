"""LayerTracer (docs/methods.md §3): `diagnosis` (logit lens, layer-wise context sensitivity and the
"train shallow, freeze deep" allocation) and `inputs` (the composite sequences they score)."""
from .diagnosis import (Diagnosis, LensProfile, SensitivityProfile, allocate, boundary_from, diagnose,
                        layer_sensitivity, logit_lens)
from .inputs import context_query_task, fewshot_topic_task

__all__ = ["Diagnosis", "LensProfile", "SensitivityProfile", "allocate", "boundary_from", "context_query_task",
           "diagnose", "fewshot_topic_task", "layer_sensitivity", "logit_lens"]
