"""What a run leaves and shows: checkpoints, the report, progress, run info, logging backends, rollout dumps."""
