"""Readers turn what users have (flags, YAML, launch commands) into a RawConfig."""
