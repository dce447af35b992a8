"""One rank's run around an engine: the loop, checkpoints, run folder, health, stop, schedule, metrics,
evaluation, initial weights. Imports planner and the rooms below it, never launch or cli."""
