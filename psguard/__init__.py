"""psguard."""
