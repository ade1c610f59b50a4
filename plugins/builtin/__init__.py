"""Built-in behaviour written as ordinary hookimpls (registered by the plugin manager)."""
