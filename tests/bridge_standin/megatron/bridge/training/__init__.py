"""Stand-in for megatron.bridge.training (see tests/bridge_standin/README.md)."""
