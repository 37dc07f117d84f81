"""The ``memguard`` command."""
