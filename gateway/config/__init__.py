"""The config: its types (:mod:`.types`, ``[telemetry]`` in :mod:`.telemetry`), reading it
(:mod:`.load`) and checking it (:mod:`.validate`). Every other part of the gateway may import
it; it imports no other part of the gateway."""
