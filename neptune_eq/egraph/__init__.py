"""The e-graph stage (the only part of neptune_eq that imports egglog)."""
