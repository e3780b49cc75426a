"""The reward loop: rule functions and served reward models.

- `loop.RewardLoop`: one score per sample, from a rule function and/or a reward model.
- `user_fn.resolve_reward_fn`: the rule function `reward.fn` names.
- `rule_worker.RuleWorker`: rule functions in a child process, under `reward.timeout_s`.
- `reward_model`: a reward model served by Ray replicas (`vllm_reward`: by vLLM).

Nothing is imported here: the rule-reward child process imports `rule_worker` without
torch, and the reward-model modules pull in Ray, transformers and the model code.
"""
