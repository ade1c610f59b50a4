"""infermux plugins."""
