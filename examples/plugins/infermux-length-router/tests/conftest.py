# infermux's plugin-author fixtures: plugin_manager, hook_recorder, plugin_gateway.
pytest_plugins = ["plugins.testing"]
