"""infermux gateway."""
