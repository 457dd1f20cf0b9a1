"""The rollout stage: a task's prompts sampled by the engine with the policy's weights, graded and
packed for the update (`controller.RolloutController`), on the ranks of `ranks.RankContext`."""
