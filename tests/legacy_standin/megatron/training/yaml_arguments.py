"""Stand-in for megatron/training/yaml_arguments.py (core_v0.16.1): names only."""


def load_yaml(yaml_path):
    raise NotImplementedError("the stand-in does not read YAML configs")


def validate_yaml(args, defaults={}):
    return args
