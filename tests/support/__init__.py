"""What the tests share: float64 references, broken variants, models, scenarios, the multi-process
harness (dist_utils). No test lives here; test modules import only from here, never from each other."""
