"""Should DDCL's default be its top-k truncation at K = 16384, judged at equal compute on the validation split?

``train`` trains the peers' short setting with checkpoints kept and no test split, ``step_cost`` times the VQ-VAE
step of each layer side by side, ``evaluate`` writes reports/topk_default (docs/scaling.md, "Top-k assignments").
"""
