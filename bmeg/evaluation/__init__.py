"""Root-cause ranking on real traces with labelled faults: the harness, the baselines, and the
zero-label bootstrap (a twin fitted from normal traces, a dataset generated from it, a model).

Import the parts from their modules (`bmeg.evaluation.rca`, `.rankers`, `.faults`, `.windows`,
`.bootstrap`); this package keeps `import bmeg.evaluation` free of torch.
"""
