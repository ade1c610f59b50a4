"""OpenAI's wire format: the request and response schemas (:mod:`.schemas`), turning a wire
request into :class:`~backends.base.GenerationRequest` s (:mod:`.request_conversion`) and a
run's chunks back into chat / completion / Responses API output, ``response_format`` and
structured outputs, and the stored responses of the Responses API.

Nothing here knows HTTP (no Litestar, no :mod:`gateway.http`); the serving layer below never
sees a wire type."""
