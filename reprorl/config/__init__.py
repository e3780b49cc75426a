"""The typed config: one dataclass per section, loaded from YAML plus `key=value` overrides.

    cfg = load_config("run.yaml", ["rollout.temperature=0.7", "trainer.loggers=[console,jsonl]"])
    print(config_to_yaml(cfg))          # the resolved config, each field's help as a comment

schema.py holds the sections and their fields, loader.py reads and writes them (YAML, type
checks, overrides), checks.py fills in derived values and checks the values that must agree.
"""

from reprorl.config.checks import reward_fn_name
from reprorl.config.loader import config_to_yaml, load_config, resolve_config
from reprorl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    FilterGroupsConfig,
    KLCtrlConfig,
    KLType,
    LossAggMode,
    ModelConfig,
    OverlongBufferConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RolloutValConfig,
    TrainerConfig,
    WeightedRewardFnConfig,
)
from reprorl.errors import ConfigError

__all__ = [
    "ActorConfig", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig", "FilterGroupsConfig",
    "KLCtrlConfig", "KLType", "LossAggMode", "ModelConfig", "OverlongBufferConfig", "ResourcesConfig",
    "RewardConfig", "RolloutConfig", "RolloutValConfig", "TrainerConfig", "WeightedRewardFnConfig",
    "config_to_yaml", "load_config", "resolve_config", "reward_fn_name",
]
